"""DSpark through the real processes: greedy text identical to no speculation on a Llama, a Qwen3
and a DeepSeek-V4 target (chunked prefill, an opted-out request, mixed lengths), with the
confidence head choosing the lengths and with every slot verified (threshold 0); after
speculated steps a prefix hit (device, host tier, disk tier) gives the cold text. The drafts
themselves are checked against a reference in tests/workers/spec_decode/test_dspark.py.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from deepinfer import LLM, SamplingParams
from scripts.tiny_models import add_dspark_weights, save_tiny_model

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
RNG = np.random.default_rng(5)
PROMPTS = [RNG.integers(3, 40000, size=n).tolist() for n in (3, 29, 12, 41)]
CHUNKED = dict(block_size=4, prefill_chunk_size=8, max_num_batched_tokens=16)


@pytest.fixture(scope="module", params=["llama", pytest.param("qwen3", marks=pytest.mark.slow),
                                        pytest.param("deepseek_v4", marks=pytest.mark.slow)])
def pair(request, tmp_path_factory):
    """A tiny target, its DSpark drafter and the engine's greedy text without speculation."""
    target = save_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    drafter = add_dspark_weights(target, tmp_path_factory.mktemp("dspark"))
    with LLM(str(target), num_kv_blocks=256, **CHUNKED) as llm:
        ref = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    return target, drafter, ref


@pytest.mark.parametrize("threshold", [0.5, pytest.param(0.0, marks=pytest.mark.slow)])
def test_greedy_text_is_identical_with_dspark(pair, threshold):
    target, drafter, ref = pair
    params = [GREEDY] * len(PROMPTS)
    params[2] = msgspec.structs.replace(GREEDY, speculative=False)
    with LLM(str(target), num_kv_blocks=256, speculative_method="dspark",
             speculative_model=str(drafter), num_speculative_tokens=3,
             speculative_confidence_threshold=threshold, **CHUNKED) as llm:
        outs = [o.token_ids for o in llm.generate(PROMPTS, params)]
        stats = llm.stats()
    assert outs == ref
    assert stats.spec_draft_tokens > 0
    if threshold == 0.0:  # every slot verified: 3 drafts a verification (fewer at the end)
        assert stats.spec_draft_tokens > 2.5 * stats.spec_verify_steps
    assert stats.kv_blocks_free == stats.kv_blocks_total


@pytest.mark.slow  # (make test's budget: the greedy identity above stays in the default run)
@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_prefix_hits_after_dspark_steps_give_the_cold_text(pair, tier, tmp_path):
    """Round two extends round one's conversations and hits the blocks speculated steps filled
    (the drafter's context K/V among them, or brought back from the host or the disk tier)."""
    target, drafter, ref = pair
    follow = [p + r[:12] + [77, 78, 79] for p, r in zip(PROMPTS, ref)]
    with LLM(str(target), num_kv_blocks=256, enable_prefix_caching=False, **CHUNKED) as llm:
        cold = [o.token_ids for o in llm.generate(follow, GREEDY)]
    extra = {"device": dict(num_kv_blocks=256),
             "host": dict(num_kv_blocks=48, host_kv_cache_gb=0.01),
             "disk": dict(num_kv_blocks=48, kv_disk_path=str(tmp_path))}[tier]
    with LLM(str(target), swa_replay="exact", speculative_method="dspark",
             speculative_model=str(drafter), num_speculative_tokens=3, **CHUNKED,
             **extra) as llm:
        first = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        outs = llm.generate(follow, GREEDY)
        stats = llm.stats()
    assert first == ref
    assert [o.token_ids for o in outs] == cold
    assert sum(o.cached_tokens for o in outs) > 0 and stats.spec_draft_tokens > 0
    if tier == "host":
        assert stats.host_blocks_in > 0
