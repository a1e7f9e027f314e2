"""The real engine (tokenizer, scheduler and worker processes) against HF transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer import LLM, SamplingParams
from scripts.tiny_models import save_tiny_model


def hf_gaps(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Per generated token: HF's best logit minus HF's logit of that token, given the same
    history, relative to the logits' scale (0 where the engine chose HF's argmax)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1]
    chosen = logits.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
    best = logits.max(dim=-1).values
    return (best - chosen) / logits.abs().max(dim=-1).values.clamp(min=1.0)


# Relative logit gap under which float32 noise from other batch shapes (chunks, preemption)
# may flip a greedy choice: ~100x float32's epsilon over a few hundred accumulated terms.
TIE = 1e-4


VARIANTS = {
    "llama": ("llama", {}),
    "qwen3": ("qwen3", dict(tie_word_embeddings=False)),
    "mistral-sliding": ("mistral", dict(sliding_window=8)),
    "qwen3-hybrid": ("qwen3", dict(num_hidden_layers=4, sliding_window=8, use_sliding_window=True,
                                   layer_types=["full_attention", "sliding_attention"] * 2)),
    "qwen3-moe": ("qwen3_moe", dict(mlp_only_layers=[1])),
    "mixtral": ("mixtral", {}),
    "qwen2-moe": ("qwen2_moe", {}),
    "gemma3": ("gemma3", dict(num_hidden_layers=6, sliding_window=8, num_key_value_heads=1)),
    "deepseek-v3": ("deepseek_v3", {}),  # MLA: decodes attend in the latent space
    # sliding, CSA and HCA layers; preempted requests resume from compressed entries + replay
    "deepseek-v4": ("deepseek_v4", {}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_32_tokens_match_hf_with_chunking_and_preemption(variant, tmp_path):
    from transformers import AutoModelForCausalLM

    arch, overrides = VARIANTS[variant]
    model_dir = save_tiny_model(tmp_path / variant, arch, **overrides)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 40000, size=n).tolist() for n in (3, 29, 12, 41, 7, 20)]
    # 40 blocks of 4 tokens cannot hold six requests of up to 73 tokens: the scheduler must
    # preempt; chunks of 8 tokens under a 16-token budget force chunked prefill.
    # Preempted requests come back through the prefix cache: for hybrid models the exact
    # replay mode keeps that identical to a cold run (window mode is approximate by contract).
    with LLM(str(model_dir), num_kv_blocks=40, block_size=4, prefill_chunk_size=8,
             max_num_batched_tokens=16, swa_replay="exact") as llm:
        params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, params)
        stats = llm.stats()
    if variant == "mistral-sliding":
        # Every layer slides: KV per request is bounded by the window, so all six fit.
        assert stats.num_preemptions == 0
    else:
        assert stats.num_preemptions > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total
    ref_model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        assert out.finish_reason == "length" and len(out.token_ids) == 32
        # Every token is HF's greedy choice after the same history, up to ties within float32
        # noise (a tiny random Gemma 3's scaled embeddings make its logits large).
        gaps = hf_gaps(ref_model, prompt, out.token_ids)
        assert float(gaps.max()) <= TIE, (gaps.max(), out.token_ids)
        assert int((gaps > 0).sum()) <= 2


def test_float16_kv_cache_greedy_matches_hf_reading_rounded_kv(tmp_path):
    """--kv-cache-dtype float16 through the real processes, with chunking, preemption and
    prefix-cache reuse: every token is the greedy choice of HF's model whose attention reads
    K/V rounded to float16 (tests/workers/models/test_kv_cache_dtype.py holds the logits to it)."""
    from tests.workers.models.test_kv_cache_dtype import hf_model

    model_dir = save_tiny_model(tmp_path / "llama", "llama")
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 40000, size=n).tolist() for n in (3, 29, 12, 41, 7, 20)]
    with LLM(str(model_dir), num_kv_blocks=40, block_size=4, prefill_chunk_size=8,
             max_num_batched_tokens=16, kv_cache_dtype="float16") as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0,
                                                    ignore_eos=True))
        stats = llm.stats()
    assert stats.num_preemptions > 0 and stats.kv_blocks_free == stats.kv_blocks_total
    ref_model = hf_model(model_dir, torch.float16)
    for prompt, out in zip(prompts, outs):
        gaps = hf_gaps(ref_model, prompt, out.token_ids)
        assert float(gaps.max()) <= TIE, (gaps.max(), out.token_ids)


def test_default_model_answers_paris(default_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    question = [{"role": "user", "content": "What is the capital of France? Answer briefly."}]
    with LLM("default") as llm:
        out = llm.chat(question, SamplingParams(max_tokens=24, temperature=0.0))
    tok = AutoTokenizer.from_pretrained(str(default_model))
    model = AutoModelForCausalLM.from_pretrained(str(default_model), dtype=torch.float32)
    ids = tok.apply_chat_template(question, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    ref = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:]
    ref_text = tok.decode(ref, skip_special_tokens=True)
    assert out.text == ref_text == "The capital of France is Paris."
    assert out.finish_reason == "stop"
