"""Tensor and expert parallelism through the real processes: two worker ranks in a gloo group,
each holding its shard of the weights (and KV heads), against one worker running the whole
model."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.engine.config import EngineConfig, ModelConfigError
from scripts.tiny_models import save_tiny_model

VARIANTS = {
    "llama-gqa": ("llama", {}),  # 4 query heads, 2 KV heads: one KV head per rank
    "qwen3-qk-norm-untied": ("qwen3", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "llama-one-kv-head": ("llama", dict(num_key_value_heads=1)),  # replicated on both ranks
    "qwen2-biases": ("qwen2", dict(num_key_value_heads=2)),
    # 9 heads in 3 KV groups, as the default model (SmolLM2-135M): 2 groups on rank 0, 1 on rank 1
    "llama-uneven-groups": ("llama", dict(hidden_size=72, num_attention_heads=9,
                                          num_key_value_heads=3)),
    # MoE under tensor parallelism: every expert's intermediate size split over the ranks
    "qwen3-moe-tp": ("qwen3_moe", dict(num_key_value_heads=2, mlp_only_layers=[1])),
    "qwen2-moe-shared-expert-tp": ("qwen2_moe", dict(num_key_value_heads=2)),
    # expert parallelism: whole experts per rank, dense layers (and MLA, V4 attention) replicated
    "qwen3-moe-ep": ("qwen3_moe", dict(num_key_value_heads=2, enable_expert_parallel=True)),
    "mixtral-ep": ("mixtral", dict(enable_expert_parallel=True)),
    "deepseek-v3-ep": ("deepseek_v3", dict(enable_expert_parallel=True)),
    "deepseek-v4-ep": ("deepseek_v4", dict(enable_expert_parallel=True)),
}


def run(model_dir, prompts, tp: int, **engine):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    with LLM(str(model_dir), tensor_parallel_size=tp, num_kv_blocks=64, block_size=4,
             prefill_chunk_size=8, max_num_batched_tokens=16, **engine) as llm:
        return llm.generate(prompts, params)


# `make test` keeps one variant per way of splitting (GQA heads, the default model's uneven KV
# groups, MoE under TP, EP with MLA and with V4's attention); the rest, shapes those ways already
# cover on other families, run in `make test-slow`.
RARE = {"qwen3-qk-norm-untied", "llama-one-kv-head", "qwen2-biases", "qwen2-moe-shared-expert-tp",
        "qwen3-moe-ep", "mixtral-ep"}


@pytest.mark.parametrize("variant", [
    pytest.param(v, marks=pytest.mark.slow) if v in RARE else v for v in sorted(VARIANTS)])
def test_two_ranks_give_the_one_rank_tokens_and_logprobs(variant, tmp_path):
    arch, overrides = VARIANTS[variant]
    engine = {k: overrides.pop(k) for k in list(overrides) if k == "enable_expert_parallel"}
    model_dir = save_tiny_model(tmp_path / variant, arch, **overrides)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 40000, size=n).tolist() for n in (3, 21, 9)]
    one, two = run(model_dir, prompts, 1), run(model_dir, prompts, 2, **engine)
    for a, b in zip(one, two):
        assert a.token_ids == b.token_ids
        diff = max(abs(x.chosen.logprob - y.chosen.logprob) for x, y in zip(a.logprobs, b.logprobs))
        assert diff < 1e-4


def test_models_that_cannot_split_are_refused_in_one_line(tmp_path):
    from deepinfer.engine.model_store import ensure_config

    v3 = save_tiny_model(tmp_path / "v3", "deepseek_v3")
    with pytest.raises(ModelConfigError, match="--enable-expert-parallel splits its experts"):
        ensure_config(EngineConfig(model=str(v3), tensor_parallel_size=2))
    dense = save_tiny_model(tmp_path / "dense", "llama")
    with pytest.raises(ModelConfigError, match="has no experts"):
        ensure_config(EngineConfig(model=str(dense), tensor_parallel_size=2,
                                   enable_expert_parallel=True))
    odd = save_tiny_model(tmp_path / "odd", "llama", num_attention_heads=3, num_key_value_heads=1,
                          hidden_size=48)  # one KV head: query heads must split evenly
    with pytest.raises(ModelConfigError, match=r"attention heads \(3\) does not split"):
        ensure_config(EngineConfig(model=str(odd), tensor_parallel_size=2))
