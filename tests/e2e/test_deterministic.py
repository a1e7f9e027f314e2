"""--deterministic through the real processes: a request's tokens and logprobs (the chosen
token's and the top alternatives', compared as exact floats) are the same alone, in batches of
2 to 64 beside other traffic (greedy and seeded sampling, other lengths), with prefill chunks
of 16 to 1024 tokens, and after prefix hits from the device cache, the host tier and the disk
tier; and they are still the model's (HF transformers' greedy choices)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer import LLM, SamplingParams
from tests.e2e.test_llm_vs_hf import TIE, hf_gaps

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(max_tokens=8, temperature=0.9, seed=11, ignore_eos=True, logprobs=3)


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 40000, n).tolist()


TARGET = prompt(150, seed=1)


def exact(out) -> tuple:
    """Everything a client sees of an output, floats as they are (no tolerance)."""
    return (out.token_ids, [(p.chosen.token_id, p.chosen.logprob,
                             [(t.token_id, t.logprob) for t in p.top]) for p in out.logprobs])


def engine(model_dir, **kw) -> LLM:
    return LLM(str(model_dir), deterministic=True, num_kv_blocks=400, block_size=4, **kw)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """TARGET's greedy and seeded outputs alone, one 1024-token chunk, no prefix cache."""
    with engine(tiny_model_dir, enable_prefix_caching=False, prefill_chunk_size=1024,
                max_num_batched_tokens=1024) as llm:
        return [exact(o) for o in (llm.generate([TARGET], GREEDY)[0],
                                   llm.generate([TARGET], SEEDED)[0])]


def traffic(n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = np.random.default_rng(seed)
    prompts = [prompt(int(rng.integers(1, 200)), seed=seed * 100 + i) for i in range(n)]
    params = [SamplingParams(max_tokens=int(rng.integers(1, 12)), ignore_eos=True,
                             temperature=float(rng.choice([0.0, 0.7, 1.0])),
                             seed=int(rng.integers(0, 1000)) if i % 2 else None)
              for i in range(n)]
    return prompts, params


def test_the_row_invariant_model_is_still_the_model(tiny_model_dir, reference):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokens = reference[0][0]
    assert float(hf_gaps(model, TARGET, tokens).max()) < TIE


@pytest.mark.parametrize("chunk", [pytest.param(16, marks=pytest.mark.slow), 64,
                                   pytest.param(1024, marks=pytest.mark.slow)])
def test_the_same_bits_in_any_batch_and_any_chunking(tiny_model_dir, reference, chunk):
    with engine(tiny_model_dir, enable_prefix_caching=False, prefill_chunk_size=chunk,
                max_num_batched_tokens=max(chunk, 64)) as llm:
        for size, where in ((1, 0), (2, 1), (8, 5), (64, 40)):
            prompts, params = traffic(size - 1, seed=size + chunk)
            for target, ref in zip((GREEDY, SEEDED), reference):
                outs = llm.generate(prompts[:where] + [TARGET] + prompts[where:],
                                    params[:where] + [target] + params[where:])
                assert exact(outs[where]) == ref, (size, chunk)


@pytest.mark.slow  # (~17 s: two engines; the default run has the device tier in test_audit)
def test_the_same_bits_after_prefix_hits_from_every_tier(tiny_model_dir, reference, tmp_path):
    # 60 blocks of 4 tokens: TARGET (38 blocks) is evicted to the host tier by other prompts.
    kw = dict(kv_disk_path=str(tmp_path), host_kv_cache_gb=0.05, num_kv_blocks=60,
              prefill_chunk_size=32, max_num_batched_tokens=64)
    with LLM(str(tiny_model_dir), deterministic=True, block_size=4, **kw) as llm:
        llm.generate([TARGET[:100]], GREEDY)
        device = llm.generate([TARGET], GREEDY)[0]  # its first 100 tokens from the device
        assert device.cached_tokens >= 96 and exact(device) == reference[0]
        for i in range(3):  # other prompts push TARGET's blocks out to the host tier
            llm.generate([prompt(150, seed=50 + i)], GREEDY)
        host = llm.generate([TARGET], SEEDED)[0]
        stats = llm.stats()
        assert stats.host_hit_tokens > 0 and exact(host) == reference[1]
    with LLM(str(tiny_model_dir), deterministic=True, block_size=4, **kw) as llm:
        disk = llm.generate([TARGET], GREEDY)[0]  # a new engine: from the disk tier
        assert llm.stats().disk_hit_tokens > 0 and exact(disk) == reference[0]
