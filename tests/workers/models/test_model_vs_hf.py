"""Per-position prefill logits against HF transformers, with the scheduler chunking the prompts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scripts.tiny_models import save_tiny_model
from tests.workers.engine_steps import run_engine

CONFIGS = {
    "llama-gqa-tied": ("llama", {}),
    "llama-untied-odd": ("llama", dict(hidden_size=48, num_attention_heads=3,
                                       num_key_value_heads=1, intermediate_size=100,
                                       tie_word_embeddings=False, num_hidden_layers=2)),
    "llama3-rope-scaling": ("llama", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=64))),
    "qwen2-qkv-bias": ("qwen2", dict(num_key_value_heads=2)),
    "qwen3-qk-norm": ("qwen3", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "mistral-sliding-window": ("mistral", dict(sliding_window=7)),
    "gemma3-hybrid": ("gemma3", dict(
        num_hidden_layers=6, sliding_window=6, num_key_value_heads=1,
        layer_types=["sliding_attention"] * 5 + ["full_attention"])),
    "qwen3-hybrid-sliding": ("qwen3", dict(
        num_hidden_layers=4, sliding_window=6, use_sliding_window=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "full_attention"])),
    # 4 experts, top-2 (scripts/tiny_models.py); layer 1 dense, top-k weights renormalized
    "qwen3-moe-mlp-only-layer": ("qwen3_moe", dict(mlp_only_layers=[1], norm_topk_prob=True,
                                                  tie_word_embeddings=False)),
    "mixtral": ("mixtral", {}),
    # experts in layers 1 and 3 only, a gated shared expert, top-k weights as routed
    "qwen2-moe-sparse-step": ("qwen2_moe", dict(num_hidden_layers=4, decoder_sparse_step=2,
                                                norm_topk_prob=False)),
    # sliding, CSA (with its indexer) and HCA layers, chunks across compression groups, hyper-
    # connections, hash and top-k routing (scripts/tiny_models.py)
    "deepseek-v4": ("deepseek_v4", {}),
    # MLA with a q bottleneck, grouped sigmoid routing, a shared expert (scripts/tiny_models.py)
    "deepseek-v3": ("deepseek_v3", {}),
    # one q projection, YaRN (softmax scale by mscale_all_dim), raw top-k weights, no rope
    # interleave
    "deepseek-v3-yarn-no-q-lora": ("deepseek_v3", dict(
        q_lora_rank=None, norm_topk_prob=False, rope_interleave=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0,
                             mscale_all_dim=0.8, original_max_position_embeddings=16,
                             beta_fast=32, beta_slow=1))),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    arch, overrides = CONFIGS[request.param]
    return save_tiny_model(tmp_path_factory.mktemp(request.param), arch, **overrides)


def hf_logits(model_dir, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_prefill_logits_match_hf_under_chunking(tiny, kernels, monkeypatch):
    """`torch`: every native CPU op reports itself unavailable, so the torch fallbacks (the
    path other devices and dtypes take) are held to HF too."""
    from deepinfer.kernels.cpu.native import NativeOp

    if kernels == "torch":
        monkeypatch.setattr(NativeOp, "available", lambda self, *tensors: False)

    rng = np.random.default_rng(0)
    prompts = {f"r{i}": rng.integers(3, 40000, size=n).tolist()
               for i, n in enumerate([5, 17, 33, 9, 1])}
    _, got, _, steps = run_engine(tiny, prompts)
    assert steps > 3, "the prompts should have been split into several chunks"
    for rid, ids in prompts.items():
        ours = got[rid]
        ref = hf_logits(tiny, ids)
        assert ours.shape == ref.shape
        diff = (ours - ref).abs().max().item()
        # float32 on both sides: what differs is only the order of reductions (chunked
        # attention, fused and blocked kernels), ~1e-6 here; a wrong key, mask, rotation or
        # weight moves these logits (spread by the 4x-scaled random weights) by 1e-2 or more.
        assert diff < 1e-3, f"{rid}: max abs logit diff {diff}"
