"""The real scheduler driven against a simulated worker that checks every KV slot a query reads.

Random configs (block sizes, KV groups with sliding windows, prefix cache, host tier, SWA replay
lengths, budgets, speculative draft slots), random traffic (shared prefixes, aborts, stop-string
finishes, EOS, drafts accepted or rejected at random), overlap on and off: whatever the scheduler
plans, every key a query attends to must hold that request's own K/V, and every block must come
back at the end.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque

import numpy as np
import pytest

from deepinfer.engine.kv_disk_files import HEADER_BYTES
from deepinfer.engine.kv_layout import FULL, SLIDING, KVGroup
from deepinfer.engine.kvcache.connectors import DiskTierSettings
from deepinfer.engine.protocol import FinishReason, SamplingParams, TokenizedRequest, pack_ids
from deepinfer.engine.scheduler.scheduler import Scheduler, SchedulerConfig
from tests.engine.sim_worker import SimulatedWorker

EOS = 2


def random_config(rng: random.Random) -> SchedulerConfig:
    block_size = rng.choice([2, 4, 8])
    groups = rng.choice([(FULL,), (FULL, SLIDING), (FULL, SLIDING), (SLIDING,)])
    window = rng.randint(3, 20) if SLIDING in groups else None
    caching = rng.random() < 0.8
    host = rng.choice([0, rng.randint(1, 4), rng.randint(4, 24)]) if caching else 0
    replay = None
    if window is not None and rng.random() < 0.4:
        replay = rng.randint(2, 3) * window  # "exact" mode: sliding layers x W
    spec = rng.choice([0, 0, rng.randint(1, 5)])
    # Snapshots inside prompts: none, about every window, or every few blocks.
    interval = rng.choice([0, window or 0, rng.randint(1, 4) * block_size])
    return SchedulerConfig(
        num_blocks=rng.randint(6, 40), block_size=block_size, max_num_seqs=rng.randint(1, 8),
        max_num_batched_tokens=rng.randint(4, 64), prefill_chunk_size=rng.randint(2, 32),
        context_len=rng.choice([64, 256]), eos_token_ids=(EOS,),
        kv_groups=tuple(KVGroup(g, window if g == SLIDING else None) for g in groups),
        prefix_caching=caching, swa_replay_tokens=replay, swa_snapshot_interval=interval,
        host_blocks=host, num_speculative_tokens=spec,
        speculative_disable_by_batch_size=rng.choice([None, rng.randint(1, 4)]))


def run_traffic(cfg: SchedulerConfig, seed: int, steps: int, lag: int) -> tuple[Scheduler, int]:
    """Random requests, aborts and stop-string finishes; results `lag` steps behind the plans
    (1 is overlap scheduling). Returns the scheduler and how many slots were checked."""
    rng = random.Random(seed)
    s = Scheduler(cfg)
    window = next((g.window for g in cfg.kv_groups if g.kind == SLIDING), None)
    worker = SimulatedWorker([g.kind for g in cfg.kv_groups], cfg.block_size, window,
                             random.Random(seed + 1), vocab=[EOS] + list(range(3, 12)) * 4)
    loads = random.Random(seed + 2)  # when the disk tier's loads report (its own draws)
    prefixes = [np.random.default_rng(seed * 10 + i).integers(3, 300, 40).tolist()
                for i in range(3)]
    in_flight: deque = deque()
    live: list[str] = []

    def land(every: bool) -> None:
        reports = worker.disk.reports
        while reports and (every or loads.random() < 0.5):
            s.connector_report(reports.pop(0))

    def deliver() -> None:
        land(False)
        step, result = in_flight.popleft()
        for delta in s.update(step, result):
            if delta.finish_reason is None and rng.random() < 0.03:
                s.abort([delta.request_id], FinishReason.STOP)  # a stop string matched

    for i in range(steps):
        if rng.random() < 0.4:
            prompt = rng.choice(prefixes)[: rng.randint(0, 40)]
            prompt += [rng.randint(3, 300) for _ in range(rng.randint(1, 10))]
            rid = f"r{i}"
            if s.add(TokenizedRequest(rid, pack_ids(prompt), SamplingParams(
                    max_tokens=rng.randint(1, 30), ignore_eos=rng.random() < 0.5))) is None:
                live.append(rid)
        if live and rng.random() < 0.05:
            s.abort([live.pop(rng.randrange(len(live)))])
        # The scheduler process applies a speculating step before planning the next one;
        # sometimes skip that here: the scheduler must stay right without it.
        if in_flight and rng.random() < 0.8 and (in_flight[-1][0].speculative
                                                 or s.wants_speculation()):
            while in_flight:
                deliver()
        step = s.schedule()
        if step is not None:
            in_flight.append((step, worker.execute(step.plan)))
        while len(in_flight) > lag or (in_flight and step is None):
            deliver()
        if step is None:
            land(True)
    while s.has_work() or in_flight or worker.disk.reports:
        step = s.schedule()
        if step is not None:
            in_flight.append((step, worker.execute(step.plan)))
        while in_flight:
            deliver()
        land(True)
    return s, worker.slots_checked


def assert_all_blocks_back(s: Scheduler) -> None:
    assert s.kv.num_reusable() == s.kv.num_total()
    if s.kv.cache is not None:
        s.kv.cache.evict(10**9)
    assert [a.num_free for a in s.kv.allocators] == [s.config.num_blocks] * len(s.kv.allocators)


@pytest.mark.parametrize("seed", range(40))
def test_random_configs_read_only_their_own_kv(seed):
    rng = random.Random(seed)
    cfg = random_config(rng)
    s, checked = run_traffic(cfg, seed, steps=250, lag=seed % 2)
    assert checked > 0
    assert_all_blocks_back(s)


@pytest.mark.parametrize("seed", range(30))
def test_host_and_disk_tiers_together_read_only_their_own_kv(seed, tmp_path):
    """Both tiers of evicted blocks at once: a device block evicted in a plan is saved (to the
    host, to disk) before any connector's load reuses it; what is read back from either tier
    is the prefix it is named after."""
    rng = random.Random(2000 + seed)
    cfg = random_config(rng)
    blocks = rng.choice([4, 16, 10**6])  # what the disk holds
    disk = DiskTierSettings(str(tmp_path), bytes(32), budget=blocks * (HEADER_BYTES + 1),
                            block_bytes=1, window_block_bytes=1)
    # A small device pool: blocks a request leaves in the cache are evicted in the next plan
    # (their disk saves not yet sent) and reused as host-tier load targets.
    cfg = dataclasses.replace(cfg, num_blocks=rng.randint(5, 10), prefix_caching=True,
                              host_blocks=rng.randint(4, 32), disk_tier=disk)
    s, checked = run_traffic(cfg, 2000 + seed, steps=250, lag=seed % 2)
    assert checked > 0
    assert_all_blocks_back(s)


@pytest.mark.parametrize("seed", range(12))
def test_speculation_reads_only_verified_kv(seed):
    """Always speculating, with aborts and stop strings mid-run and preemption from a small
    pool: rejected drafts' slots are never read, nothing leaks."""
    rng = random.Random(1000 + seed)
    cfg = dataclasses.replace(random_config(rng), num_speculative_tokens=rng.randint(1, 5),
                              speculative_disable_by_batch_size=None)
    s, checked = run_traffic(cfg, 1000 + seed, steps=250, lag=seed % 2)
    assert checked > 0 and s.spec.draft_tokens > 0
    assert 0 < s.spec.accepted_tokens < s.spec.draft_tokens
    assert_all_blocks_back(s)


def test_host_tier_swap_in_reads_the_blocks_it_looked_up():
    """A is evicted to the host tier, B's eviction must not recycle A's host blocks between
    looking them up and pinning them (the swap-in would restore B's data)."""
    cfg = SchedulerConfig(num_blocks=4, block_size=4, max_num_batched_tokens=64,
                          prefill_chunk_size=64, context_len=64, eos_token_ids=(EOS,),
                          host_blocks=2)
    s = Scheduler(cfg)
    worker = SimulatedWorker([FULL], 4, None, random.Random(0), vocab=[5])
    a, b = list(range(100, 109)), list(range(200, 213))
    for rid, prompt in (("a1", a), ("b", b), ("a2", a)):
        s.add(TokenizedRequest(rid, pack_ids(prompt), SamplingParams(max_tokens=1)))
        while s.has_work():
            step = s.schedule()
            s.update(step, worker.execute(step.plan))
    assert s.stats().host_blocks_in > 0  # a2 really was served from the host tier
    assert_all_blocks_back(s)


def test_one_plan_never_swaps_two_blocks_into_one_host_block():
    """Evicting more blocks in one plan than the host tier holds must not send two device
    blocks to the same host block (the worker's indexed copy keeps either one)."""
    cfg = SchedulerConfig(num_blocks=8, block_size=2, max_num_batched_tokens=64,
                          prefill_chunk_size=64, context_len=64, eos_token_ids=(EOS,),
                          host_blocks=2)
    s = Scheduler(cfg)
    worker = SimulatedWorker([FULL], 2, None, random.Random(0), vocab=[5])
    for rid, start in (("a", 100), ("b", 200), ("c", 300)):
        s.add(TokenizedRequest(rid, pack_ids(range(start, start + 13)),
                               SamplingParams(max_tokens=1)))
        while s.has_work():
            step = s.schedule()
            copies = step.plan.connectors.get("host_tier")
            saves = copies.saves if copies is not None else b""
            targets = [h for _, h in np.frombuffer(saves, np.int32).reshape(-1, 2)]
            assert len(targets) == len(set(targets)), targets
            s.update(step, worker.execute(step.plan))
    assert s.stats().host_blocks_out > 2
