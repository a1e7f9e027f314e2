"""The disk tier's scheduler half and its files, driven by a scheduler and a stand-in for the
worker half that keeps each device block's token ids as its "KV" and writes real block files:
whatever the scheduler reuses (from the device, or read back from disk) must hold exactly the
tokens of the prefix it stands for."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import numpy as np
import pytest

from deepinfer.engine.kv_disk_files import (
    HEADER_BYTES,
    DamagedBlock,
    block_path,
    rank_dir,
    read_block,
    scan,
    write_block,
)
from deepinfer.engine.kv_identity import identity_key
from deepinfer.engine.kvcache.connectors.disk_tier import DiskTier, DiskTierSettings
from deepinfer.engine.protocol import (
    DiskTierWork,
    DiskWrites,
    KVTransferDone,
    SamplingParams,
    StepResult,
    TokenizedRequest,
    pack_ids,
    unpack_ids,
)
from deepinfer.engine.request import Status
from deepinfer.engine.scheduler.scheduler import Scheduler, SchedulerConfig

BS = 4
ID = identity_key("tiny:LlamaForCausalLM", "float32", "float32", BS, "tp1")
PAYLOAD = BS * 4  # a block's "KV": its token ids as int32


def digests(packed: bytes) -> list[bytes]:
    return [packed[i:i + 32] for i in range(0, len(packed), 32)]


class FakeWorker:
    """The worker half's contract over a dict of device blocks: saves read a block after (or,
    for `saves_now`, before) the forward; loads land later, when `finish_loads` reports them."""

    def __init__(self, sched: Scheduler, root: Path, num_blocks: int) -> None:
        self.sched, self.folder = sched, rank_dir(root, ID, 0)
        self.device = [[None] * BS for _ in range(num_blocks)]
        self.loads = []

    def _save(self, blocks: bytes, names: bytes) -> None:
        for b, d in zip(unpack_ids(blocks), digests(names)):
            assert None not in self.device[b], "saving a block that was never computed"
            write_block(self.folder, d, ID, np.array(self.device[b], np.int32).tobytes())

    def step(self, plan) -> None:
        entry: DiskTierWork | None = plan.plan.connectors.get("disk_tier")
        if entry is not None:
            self._save(entry.saves_now, entry.save_now_digests)
            for d in digests(entry.deletes):
                block_path(self.folder, d).unlink(missing_ok=True)
            self.loads += entry.loads
        for req, seq in plan.scheduled:  # the forward: check what it reads, write what it computes
            table = unpack_ids(seq.block_tables[0])
            tokens = req.tokens(0, seq.start_pos + len(unpack_ids(seq.token_ids)))
            for pos in range(seq.start_pos):
                assert self.device[table[pos // BS]][pos % BS] == tokens[pos], (req.request_id, pos)
            for pos in range(seq.start_pos, len(tokens)):
                self.device[table[pos // BS]][pos % BS] = int(tokens[pos])
        if entry is not None:
            self._save(entry.saves, entry.save_digests)

    def finish_loads(self) -> None:
        loads, self.loads = self.loads, []
        for load in loads:
            good, error = 0, None
            for b, d in zip(unpack_ids(load.blocks), digests(load.digests)):
                try:
                    payload = read_block(self.folder, d, ID, PAYLOAD)
                except FileNotFoundError:
                    error = "gone"
                    break
                except DamagedBlock as e:
                    error = str(e)
                    break
                self.device[b] = np.frombuffer(payload, np.int32).tolist()
                good += 1
            self.sched.connector_report(KVTransferDone(load.request_id, 0, blocks=good,
                                                       error=error))


def settings(root: Path, blocks: int) -> DiskTierSettings:
    """Room for `blocks` blocks (their files: header and payload)."""
    return DiskTierSettings(str(root), ID, blocks * (HEADER_BYTES + PAYLOAD), PAYLOAD)


def make(root: Path, num_blocks: int = 16, disk_blocks: int = 1000) -> tuple[Scheduler, FakeWorker]:
    sched = Scheduler(SchedulerConfig(
        num_blocks=num_blocks, block_size=BS, max_num_seqs=4, max_num_batched_tokens=64,
        context_len=64, disk_tier=settings(root, disk_blocks)))
    return sched, FakeWorker(sched, root, num_blocks)


def run(sched: Scheduler, worker: FakeWorker, steps: int = 100) -> None:
    for _ in range(steps):
        plan = sched.schedule()
        if plan is None:
            if not worker.loads:
                return
            worker.finish_loads()
            continue
        worker.step(plan)
        n = sum(seq.sample for _, seq in plan.scheduled)
        sched.update(plan, StepResult(plan.plan.step_id, pack_ids([7] * n)))
        worker.finish_loads()


def add(sched: Scheduler, rid: str, prompt: list[int], max_tokens: int = 2) -> None:
    sched.add(TokenizedRequest(rid, pack_ids(prompt), SamplingParams(
        max_tokens=max_tokens, ignore_eos=True)))


def disk(sched: Scheduler) -> DiskTier:
    return next(c for c in sched.connectors if isinstance(c, DiskTier))


def test_blocks_reach_disk_as_they_are_cached_and_a_new_server_reads_them(tmp_path):
    prompt = list(range(100, 121))  # 5 full blocks and one token
    sched, worker = make(tmp_path)
    add(sched, "a", prompt)
    run(sched, worker)
    files = sorted(d for d, _, _ in scan(rank_dir(tmp_path, ID, 0)))
    assert len(files) == 5 and sorted(disk(sched).index) == files  # no eviction needed
    # A restarted server: an empty device cache; the prefix comes from disk.
    sched, worker = make(tmp_path)
    assert len(disk(sched).index) == 5
    add(sched, "b", prompt + [5, 6, 7])
    plan = sched.schedule()
    assert not plan.scheduled  # it waits for its loads and computes nothing yet
    assert sched.requests["b"].status == Status.LOADING
    worker.step(plan)
    sched.update(plan, StepResult(plan.plan.step_id, b""))
    run(sched, worker)  # the worker asserts that the loaded blocks hold the prompt's tokens
    stats = sched.stats()
    assert stats.disk_hit_tokens == 20 and stats.prefix_cache_hits == 20
    assert stats.generation_tokens_total == 2
    assert sum(stats.disk_read_buckets) == 1  # one read: the request's five blocks


def test_under_eviction_pressure_every_reused_block_holds_its_prefix(tmp_path):
    """Random conversations over a device cache far smaller than their prefixes: blocks move
    to disk and back; the worker checks every block a step reads."""
    rng = random.Random(1)
    sched, worker = make(tmp_path, num_blocks=24, disk_blocks=40)
    bases = [[rng.randrange(1000) for _ in range(rng.randrange(8, 40))] for _ in range(6)]
    for i in range(60):
        base = rng.choice(bases)
        add(sched, f"r{i}", base[: rng.randrange(4, len(base) + 1)]
            + [rng.randrange(1000) for _ in range(rng.randrange(6))], rng.randrange(1, 5))
        run(sched, worker, steps=rng.randrange(1, 6))
    run(sched, worker, steps=1000)
    stats = sched.stats()
    assert not sched.requests and stats.disk_hit_tokens > 0 and sched.kv.cache.evictions > 0
    assert stats.disk_blocks_used <= 40
    assert len(list(scan(rank_dir(tmp_path, ID, 0)))) <= 40  # LRU by size, files deleted
    assert sched.kv.num_reusable() == sched.kv.num_total()  # no block leaked


def test_a_damaged_block_is_recomputed_and_the_blocks_before_it_still_load(tmp_path):
    prompt = list(range(200, 217))
    sched, worker = make(tmp_path)
    add(sched, "a", prompt)
    run(sched, worker)
    sched, worker = make(tmp_path)
    third = disk(sched).match(np.array(prompt), 0, 16)
    names = disk(sched)._found
    path = block_path(rank_dir(tmp_path, ID, 0), names[2])
    path.write_bytes(path.read_bytes()[:-1] + b"\xff")  # a flipped byte
    sched, worker = make(tmp_path)
    assert len(third) == 4
    add(sched, "b", prompt)
    run(sched, worker)
    assert "b" not in sched.requests
    # The first try failed at the third block; the retry loaded two from disk and computed on,
    # and the recomputed block was saved again, whole.
    assert sched.stats().disk_hit_tokens == 2 * BS
    assert np.frombuffer(read_block(path.parent.parent, names[2], ID, PAYLOAD),
                         np.int32).tolist() == prompt[8:12]


def test_a_request_aborted_while_loading_frees_its_blocks_only_after_the_loads(tmp_path):
    prompt = list(range(300, 317))
    sched, worker = make(tmp_path)
    add(sched, "a", prompt)
    run(sched, worker)
    sched, worker = make(tmp_path)
    add(sched, "b", prompt)
    plan = sched.schedule()
    worker.step(plan)
    sched.update(plan, StepResult(plan.plan.step_id, b""))
    sched.abort(["b"])
    assert sched.kv.num_free() < sched.kv.num_total()  # the loads still write into them
    worker.finish_loads()
    assert sched.kv.num_free() == sched.kv.num_total()
    assert not sched.has_connector_work()


def test_blocks_other_servers_write_are_found_on_a_lookup_miss(tmp_path):
    prompt = list(range(400, 417))
    reader, reader_worker = make(tmp_path)  # started before the files exist
    writer, writer_worker = make(tmp_path)
    add(writer, "w", prompt)
    run(writer, writer_worker)
    assert not disk(reader).index
    add(reader, "r", prompt)
    run(reader, reader_worker)
    assert reader.stats().disk_hit_tokens == 16


def test_a_block_evicted_before_its_save_is_planned_is_saved_before_the_forward(tmp_path):
    sched, _ = make(tmp_path)
    tier = disk(sched)
    tier.on_stored(None, list(range(8)), [3, 5])
    tier.on_evict(list(range(8)), 5)
    entry = tier.plan_entry()
    assert list(unpack_ids(entry.saves)) == [3] and list(unpack_ids(entry.saves_now)) == [5]


def test_failed_writes_are_forgotten(tmp_path):
    sched, _ = make(tmp_path)
    tier = disk(sched)
    tier.on_stored(None, list(range(8)), [3, 5])
    names = list(tier.index)
    sched.connector_report(DiskWrites(0, blocks=1, nbytes=100, seconds=[0.01],
                                      failed=names[1]))
    assert list(tier.index) == names[:1]
    stats = sched.stats()
    assert stats.disk_bytes_written == 100 and sum(stats.disk_write_buckets) == 1


# ---------------------------------------------------------------------- the files


def test_a_file_is_checked_for_damage_truncation_and_foreign_keys(tmp_path):
    folder = rank_dir(tmp_path, ID, 0)
    name, other = b"\x01" * 32, b"\x02" * 32
    payload = bytes(range(PAYLOAD))
    assert write_block(folder, name, ID, payload) == HEADER_BYTES + PAYLOAD
    assert read_block(folder, name, ID, PAYLOAD) == payload
    path = block_path(folder, name)
    good = path.read_bytes()
    for bad in (good[:-1], good + b"x", good[:-1] + b"\x00", b"garbage" + good[7:]):
        path.write_bytes(bad)
        with pytest.raises(DamagedBlock):
            read_block(folder, name, ID, PAYLOAD)
    path.write_bytes(good)
    with pytest.raises(DamagedBlock):  # another model's key
        read_block(folder, name, identity_key("x", "float32", "float32", BS), PAYLOAD)
    os.replace(path, block_path(folder, other).parent.mkdir(parents=True, exist_ok=True)
               or block_path(folder, other))
    with pytest.raises(DamagedBlock):  # another block's file under this name
        read_block(folder, other, ID, PAYLOAD)


def test_scan_skips_temporary_files_and_sweeps_stale_ones(tmp_path):
    folder = rank_dir(tmp_path, ID, 0)
    write_block(folder, b"\x03" * 32, ID, b"x" * PAYLOAD)
    sub = block_path(folder, b"\x03" * 32).parent
    fresh, stale = sub / ".a.kv.1.tmp", sub / ".b.kv.2.tmp"
    fresh.write_bytes(b"partial")
    stale.write_bytes(b"partial")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    assert [d for d, _, _ in scan(folder)] == [b"\x03" * 32]
    assert fresh.exists() and not stale.exists()


def test_the_disk_tier_reports_its_blocks_as_kv_events_on_the_disk_medium(tmp_path):
    import msgspec

    from deepinfer.engine.kvcache.block_hash import external_hash

    sched = Scheduler(SchedulerConfig(
        num_blocks=16, block_size=BS, max_num_seqs=4, max_num_batched_tokens=64,
        context_len=64, kv_events_identity=ID,
        disk_tier=settings(tmp_path, 3)))
    worker = FakeWorker(sched, tmp_path, 16)
    add(sched, "a", list(range(500, 517)))
    run(sched, worker)
    events = msgspec.msgpack.decode(msgspec.msgpack.encode(sched.kv_events.take()))
    stored = [e for e in events if e[0] == "BlockStored" and e[6] == "DISK"]
    removed = [h for e in events if e[0] == "BlockRemoved" and e[2] == "DISK" for h in e[1]]
    assert [len(e[3]) for e in stored] == [BS] * 4  # one event per block, its own tokens
    assert stored[1][2] == stored[0][1][0]  # chained on its parent
    assert len(removed) == 1  # a size of three: the oldest went
    assert {external_hash(d) for d in disk(sched).index} == (
        {e[1][0] for e in stored} - set(removed))


def test_a_snapshot_is_saved_after_the_forward_unless_dropped_before_its_plan(tmp_path):
    from deepinfer.engine.kvcache.block_hash import chain, snapshot_digest
    from deepinfer.engine.kvcache.radix_cache import Snapshot

    sched, _ = make(tmp_path)
    tier = disk(sched)
    tier.on_stored(None, list(range(8)), [3, 5])
    kept, dropped = Snapshot(0, [7, 8]), Snapshot(1, [9])
    tier.on_snapshot(5, kept)
    tier.on_snapshot(3, dropped)
    tier.on_snapshot_drop(dropped)  # its blocks may be reused by this plan: not saved
    entry = tier.plan_entry()
    name = snapshot_digest(chain(list(range(8)), BS, ID)[1])
    assert [(w.digest, list(unpack_ids(w.blocks))) for w in entry.window_saves] == [
        (name, [7, 8])]
    assert name in tier.index and len(tier.index) == 3


def test_an_admission_chains_its_prompts_digests_once(tmp_path, monkeypatch):
    """match() and match_snapshot() of one admission look the same prompt up: its digests are
    chained once between them; another prompt gets its own."""
    from deepinfer.engine.kvcache.block_hash import chain
    from deepinfer.engine.kvcache.connectors import disk_tier
    from deepinfer.engine.kvcache.radix_cache import Snapshot

    chained = []

    def counting_chain(tokens, block_size, identity, parent=None):
        chained.append(len(tokens) // block_size)
        return chain(tokens, block_size, identity, parent)

    sched, _ = make(tmp_path)
    tier = disk(sched)
    prompt = np.arange(17)
    tier.on_stored(None, prompt[:16], [1, 2, 3, 4])
    tier.on_snapshot(3, Snapshot(0, [7]))  # where the third block ends
    monkeypatch.setattr(disk_tier, "chain", counting_chain)
    assert len(tier.match(prompt, 0, 16)) == 4
    assert tier.match_snapshot(prompt, 16, 0) == (12, 4)  # the handle after match()'s four
    assert chained == [4]
    assert tier.match(np.arange(100, 117), 0, 16) == [] and chained == [4, 4]


# ---------------------------------------------------------------------- the budget, in bytes


def on_disk(root: Path) -> dict[bytes, int]:
    return {d: size for d, _, size in scan(rank_dir(root, ID, 0))}


def test_blocks_trimmed_in_the_plan_that_saves_them_are_never_written(tmp_path):
    """A prompt of four blocks into a tier that holds two: the two oldest go in the plan that
    caches them, so they are not saved (they were deleted before the forward and written
    after it, left on disk unindexed, beyond the budget)."""
    sched, worker = make(tmp_path, disk_blocks=2)
    add(sched, "a", list(range(600, 617)))
    run(sched, worker)
    files = on_disk(tmp_path)
    assert sorted(files) == sorted(disk(sched).index) and len(files) == 2
    assert sched.stats().disk_used_bytes == sum(files.values())


def test_a_snapshot_counts_the_bytes_of_each_of_its_blocks(tmp_path):
    from deepinfer.engine.kvcache.radix_cache import Snapshot

    budget = 3 * (HEADER_BYTES + PAYLOAD)
    sched = Scheduler(SchedulerConfig(
        num_blocks=16, block_size=BS, max_num_seqs=4, max_num_batched_tokens=64,
        context_len=64, disk_tier=DiskTierSettings(str(tmp_path), ID, budget, PAYLOAD,
                                                   window_block_bytes=PAYLOAD)))
    tier = disk(sched)
    tier.on_stored(None, list(range(8)), [3, 5])
    tier.on_snapshot(5, Snapshot(0, list(range(4, 16))))  # twelve blocks' rows: about 3 files
    assert sched.stats().disk_used_bytes <= budget
    assert len(tier.index) == 1  # the snapshot alone fits, the two blocks before it went


def test_the_disk_budget_counts_a_draft_models_rows(tiny_model_dir):
    from deepinfer.engine.config import EngineConfig
    from deepinfer.engine.scheduler.scheduler_process import disk_tier_settings

    plain = EngineConfig(model=str(tiny_model_dir), kv_disk_path="/nowhere", kv_disk_gb=1.0)
    draft = EngineConfig(model=str(tiny_model_dir), kv_disk_path="/nowhere", kv_disk_gb=1.0,
                         speculative_method="draft", speculative_model=str(tiny_model_dir))
    assert disk_tier_settings(draft).block_bytes == 2 * disk_tier_settings(plain).block_bytes
    assert disk_tier_settings(plain).budget == 1 << 30


# ---------------------------------------------------------------------- KV events of the tier


def disk_events(sched: Scheduler) -> tuple[list, list]:
    import msgspec

    events = msgspec.msgpack.decode(msgspec.msgpack.encode(sched.kv_events.take()))
    stored = [h for e in events if e[0] == "BlockStored" and e[6] == "DISK" for h in e[1]]
    removed = [h for e in events if e[0] == "BlockRemoved" and e[2] == "DISK" for h in e[1]]
    return stored, removed


def events_tier(root: Path, blocks: int = 1000) -> tuple[Scheduler, FakeWorker]:
    sched = Scheduler(SchedulerConfig(
        num_blocks=16, block_size=BS, max_num_seqs=4, max_num_batched_tokens=64,
        context_len=64, kv_events_identity=ID, disk_tier=settings(root, blocks)))
    return sched, FakeWorker(sched, root, 16)


def test_a_failed_write_withdraws_its_disk_event(tmp_path):
    from deepinfer.engine.kvcache.block_hash import external_hash

    sched, _ = events_tier(tmp_path)
    tier = disk(sched)
    tier.on_stored(None, list(range(8)), [3, 5])
    names = list(tier.index)
    sched.connector_report(DiskWrites(0, blocks=1, failed=names[1]))
    stored, removed = disk_events(sched)
    assert removed == [external_hash(names[1])] and set(removed) <= set(stored)


def test_blocks_found_on_disk_are_announced_when_met_and_only_announced_ones_withdrawn(
        tmp_path):
    from deepinfer.engine.kvcache.block_hash import external_hash

    prompt = list(range(700, 717))
    writer, writer_worker = make(tmp_path)
    add(writer, "w", prompt)
    run(writer, writer_worker)  # four blocks on disk
    sched, worker = events_tier(tmp_path, blocks=6)
    assert disk_events(sched) == ([], [])  # found at start: no tokens known, nothing said
    add(sched, "r", prompt)
    run(sched, worker)
    stored, removed = disk_events(sched)
    assert {external_hash(d) for d in disk(sched).index} <= set(stored)
    add(sched, "x", list(range(800, 833)))  # eight more blocks: the older ones are trimmed
    run(sched, worker)
    stored2, removed2 = disk_events(sched)
    assert set(removed2) <= set(stored) | set(stored2)  # never a hash that was not stored
    assert removed2
