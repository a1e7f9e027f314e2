"""A request's cache_salt (vLLM's field) mixed into its blocks' identity: requests share cached
KV only with requests of the same salt, in the device cache, on disk and in KV events, so a
client cannot learn from cached_tokens whether another tenant sent a prompt."""

from __future__ import annotations

from pathlib import Path

import msgspec

from deepinfer.engine.kv_identity import request_salt
from deepinfer.engine.protocol import SamplingParams, TokenizedRequest, pack_ids
from deepinfer.engine.scheduler.scheduler import Scheduler, SchedulerConfig
from tests.engine.kvcache.test_disk_tier import BS, ID, FakeWorker, run, settings

PROMPT = list(range(900, 917))  # four full blocks


def make(root: Path) -> tuple[Scheduler, FakeWorker]:
    sched = Scheduler(SchedulerConfig(
        num_blocks=32, block_size=BS, max_num_seqs=4, max_num_batched_tokens=64,
        context_len=64, kv_events_identity=ID, disk_tier=settings(root, 1000)))
    return sched, FakeWorker(sched, root, 32)


def hits(sched: Scheduler, worker: FakeWorker, rid: str, salt: str | None) -> int:
    """Prompt tokens of one request found cached (device or disk)."""
    before = sched.stats().prefix_cache_hits
    sched.add(TokenizedRequest(rid, pack_ids(PROMPT), SamplingParams(
        max_tokens=1, ignore_eos=True, cache_salt=salt)))
    run(sched, worker)
    return sched.stats().prefix_cache_hits - before


def test_only_requests_of_the_same_salt_share_cached_blocks(tmp_path):
    sched, worker = make(tmp_path)
    assert hits(sched, worker, "a1", "tenant-a") == 0
    assert hits(sched, worker, "b1", "tenant-b") == 0  # another tenant's prompt: not seen
    assert hits(sched, worker, "n1", None) == 0  # nor without a salt
    assert hits(sched, worker, "a2", "tenant-a") == 16
    assert hits(sched, worker, "n2", None) == 16
    # A new server over the same directory: the disk tier keeps them apart too.
    sched, worker = make(tmp_path)
    assert hits(sched, worker, "c1", "tenant-c") == 0
    assert hits(sched, worker, "a3", "tenant-a") == 16
    assert sched.stats().disk_hit_tokens == 16


def test_salted_blocks_have_their_own_hashes_in_kv_events(tmp_path):
    sched, worker = make(tmp_path)
    hits(sched, worker, "n", None)
    hits(sched, worker, "a", "tenant-a")
    events = msgspec.msgpack.decode(msgspec.msgpack.encode(sched.kv_events.take()))
    stored = [e for e in events if e[0] == "BlockStored" and e[6] == "GPU"]
    plain, salted = stored[0], stored[1]
    assert plain[3] == salted[3] == PROMPT[:16]  # the tokens as sent, both times
    assert not set(plain[1]) & set(salted[1])
    assert plain[5] is None and salted[5] == request_salt(0, "tenant-a")


def test_a_salt_is_its_own_and_not_an_adapters():
    assert request_salt(0, None) == 0 and request_salt(5, None) == 5
    assert request_salt(0, "x") != request_salt(5, "x") != request_salt(5, "y")
    assert 0 < request_salt(0, "x") < 2**31


