"""Sampling settings through the real engine processes (offline LLM on a tiny random model)."""

from __future__ import annotations

import msgspec
import numpy as np

from deepinfer import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def test_a_tiny_temperature_is_greedy(tiny_model_dir):
    """temperature 1e-40 gives exactly the greedy text (it would overflow to NaN probabilities
    and repeat the last vocabulary id), also with a draft model's sampled proposals."""
    prompts = [np.random.default_rng(i).integers(3, 40000, 8).tolist() for i in range(2)]
    tiny = [msgspec.structs.replace(GREEDY, temperature=1e-40, seed=s) for s in (None, 5)]
    with LLM(str(tiny_model_dir), num_kv_blocks=128, block_size=4) as llm:
        ref = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert [o.token_ids for o in llm.generate(prompts, tiny)] == ref
    with LLM(str(tiny_model_dir), num_kv_blocks=128, block_size=4, speculative_method="draft",
             speculative_model=str(tiny_model_dir)) as llm:
        assert [o.token_ids for o in llm.generate(prompts, tiny)] == ref
        stats = llm.stats()
    assert stats.spec_draft_tokens > 0
