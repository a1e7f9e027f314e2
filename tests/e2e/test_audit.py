"""The exactness audit (--audit-rate) through the real processes: with nothing broken a mixed
workload (prefix hits from the device and disk tiers, sliding-window snapshots, batches,
sampling) re-runs cold with no divergence; a fault planted on purpose (a disk-tier block file
changed with a checksum to match, as a faulty writer would leave it; snapshot restore taken
away so that a hit replays an approximate window) is reported under the shortcut that took it."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import numpy as np
import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.engine.kv_disk_files import HEADER_BYTES, MAGIC, checksum
from scripts.tiny_models import save_tiny_model

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
W = 8


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 40000, n).tolist()


def audited(llm: LLM, runs: int, timeout: float = 60.0):
    """The engine's statistics once `runs` cold re-runs were compared."""
    deadline = time.monotonic() + timeout
    while True:
        stats = llm.stats()
        if stats.audit_requests >= runs and stats.audit_pending == 0:
            return stats
        assert time.monotonic() < deadline, f"{stats.audit_requests} of {runs} re-runs done"
        time.sleep(0.05)


def engine(model_dir, **kw) -> LLM:
    return LLM(str(model_dir), num_kv_blocks=200, block_size=4, audit_rate=1.0, **kw)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> Path:
    """A Qwen3 hybrid: two sliding layers (W = 8) of four."""
    return save_tiny_model(
        tmp_path_factory.mktemp("hybrid"), "qwen3", num_hidden_layers=4, sliding_window=W,
        use_sliding_window=True, layer_types=["sliding_attention", "full_attention",
                                              "sliding_attention", "full_attention"])


@pytest.mark.slow  # (~15 s; the default run has the mixed workload under --deterministic)
def test_nothing_broken_nothing_diverges_over_a_mixed_workload(tiny_model_dir, tmp_path):
    base = prompt(40, seed=1)
    with engine(tiny_model_dir, kv_disk_path=str(tmp_path)) as llm:
        llm.generate([base], GREEDY)
        batch = [base + prompt(6, seed=s) for s in range(2, 6)] + [prompt(30, seed=9)]
        params = [GREEDY, SamplingParams(max_tokens=6, temperature=0.8, seed=3),
                  SamplingParams(max_tokens=6, temperature=1.0), GREEDY,
                  SamplingParams(max_tokens=6, temperature=0.7, top_k=20)]
        outs = llm.generate(batch, params)  # together: a shared batch, prefix hits
        assert sum(o.cached_tokens for o in outs) > 0
        assert all(not o.logprobs for o in outs)  # computed for the audit, never sent
        stats = audited(llm, 6)
    assert stats.audit_requests == 6 and stats.audit_divergences == {}
    assert stats.audit_largest_logprob_diff < 1e-3
    with engine(tiny_model_dir, kv_disk_path=str(tmp_path)) as llm:  # the disk tier's blocks
        again = llm.generate([base + prompt(6, seed=2)], GREEDY)[0]
        assert again.cached_tokens > 0 and llm.stats().disk_hit_tokens > 0
        stats = audited(llm, 1)
    assert stats.audit_divergences == {}


def test_under_deterministic_reruns_match_to_the_bit(tiny_model_dir, tmp_path):
    """With --deterministic the tolerance is 0: batches, chunks and prefix hits must leave no
    logprob difference at all."""
    base = prompt(40, seed=1)
    with engine(tiny_model_dir, deterministic=True, kv_disk_path=str(tmp_path),
                prefill_chunk_size=16, max_num_batched_tokens=32) as llm:
        llm.generate([base], GREEDY)
        batch = [base + prompt(6, seed=s) for s in range(2, 6)] + [prompt(30, seed=9)]
        params = [GREEDY, SamplingParams(max_tokens=6, temperature=0.8, seed=3),
                  SamplingParams(max_tokens=6, temperature=1.0), GREEDY, GREEDY]
        outs = llm.generate(batch, params)
        assert sum(o.cached_tokens for o in outs) > 0
        stats = audited(llm, 6)
    assert stats.audit_divergences == {} and stats.audit_largest_logprob_diff == 0.0


def corrupt_one_value(path: Path, delta: float = 8.0) -> None:
    """One float32 of the block's K/V changed, the header's checksum recomputed to match."""
    data = bytearray(path.read_bytes())
    magic, ident, digest, size, _ = struct.unpack_from("<8s32s32sQI", data)
    assert magic == MAGIC
    at = HEADER_BYTES + 4 * 7
    (value,) = struct.unpack_from("<f", data, at)
    struct.pack_into("<f", data, at, value + delta)
    payload = bytes(data[HEADER_BYTES:])
    struct.pack_into("<8s32s32sQI", data, 0, magic, ident, digest, size, checksum(payload))
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("deterministic,delta", [
    (False, 8.0), pytest.param(True, 1e-3, marks=pytest.mark.slow)],
    ids=["default", "deterministic_small_change"])
def test_a_disk_block_changed_with_a_matching_checksum_is_reported_under_prefix_disk(
        tiny_model_dir, tmp_path, deterministic, delta, capfd):
    """A large change moves logprobs past the default tolerance; under --deterministic (no
    tolerance) a change of 1e-3 in one value is enough, and the scheduler logs it as an
    error (a bug), else as a warning."""
    base = prompt(40, seed=1)
    with LLM(str(tiny_model_dir), num_kv_blocks=200, block_size=4,
             kv_disk_path=str(tmp_path), deterministic=deterministic) as llm:
        llm.generate([base], GREEDY)
    files = sorted(tmp_path.rglob("*.kv"))
    assert files
    for path in files:
        corrupt_one_value(path, delta)
    with engine(tiny_model_dir, kv_disk_path=str(tmp_path), deterministic=deterministic) as llm:
        out = llm.generate([base + prompt(6, seed=2)], GREEDY)[0]
        stats = audited(llm, 1)
    assert out.cached_tokens > 0 and stats.disk_corrupt_blocks == 0  # it passed the check
    assert stats.audit_divergences == {"prefix_disk": 1}
    (found,) = stats.audit_latest
    assert found.shortcuts == ["prefix_disk"] and found.max_logprob_diff > 0.0
    level = "ERROR" if deterministic else "WARNING"
    assert f"scheduler {level} audit: request {found.request_id} diverged" in capfd.readouterr().err


@pytest.mark.parametrize("snapshots,deterministic", [(True, False), (False, False),
                                                     (False, True)],
                         ids=["restored", "not_restored", "not_restored_deterministic"])
def test_without_snapshot_restore_a_window_replay_is_reported(hybrid, snapshots, deterministic):
    """The second prompt's hit ends 6 tokens past a snapshot point: restored from it, the
    sliding layers are exact; with no snapshot to restore (interval 0: only at a prompt's end,
    far beyond), W tokens are replayed, which is approximate beyond the first sliding layer;
    --deterministic replays every sliding layer's window (exact), to the bit."""
    first = prompt(12 * W, seed=3)
    second = first[:10 * W + 6] + prompt(5, seed=4)
    with engine(hybrid, swa_snapshot_interval=None if snapshots else 0,
                deterministic=deterministic) as llm:
        llm.generate([first], GREEDY)
        out = llm.generate([second], GREEDY)[0]
        stats = audited(llm, 2)
    assert out.cached_tokens > 0
    if snapshots:
        assert stats.swa_snapshot_hits == 1 and stats.audit_divergences == {}
    elif deterministic:
        assert stats.replayed_tokens > W and stats.audit_divergences == {}
        assert stats.audit_largest_logprob_diff == 0.0
    else:
        assert stats.swa_snapshot_hits == 0
        assert stats.audit_divergences == {"prefix_device": 1, "swa_replay_window": 1}
