"""KV groups, sliding-window block release and leak freedom, with no model."""

from __future__ import annotations

import random

import numpy as np

from deepinfer.engine.kv_layout import FULL, SLIDING, KVGroup
from deepinfer.engine.protocol import SamplingParams, StepResult, TokenizedRequest, pack_ids
from deepinfer.engine.scheduler.scheduler import Scheduler, SchedulerConfig


def hybrid(num_blocks=64, budget=32, chunk=16, window=8, caching=True, max_seqs=8, host=0):
    return Scheduler(SchedulerConfig(
        num_blocks=num_blocks, block_size=4, max_num_seqs=max_seqs,
        max_num_batched_tokens=budget, prefill_chunk_size=chunk, context_len=4096,
        eos_token_ids=(2,), kv_groups=(KVGroup(FULL), KVGroup(SLIDING, window)),
        prefix_caching=caching, host_blocks=host))


def finish(s: Scheduler, step, token=7):
    n = sum(seq.sample for _, seq in step.scheduled)
    return s.update(step, StepResult(step.plan.step_id, pack_ids([token] * n)))


def test_sliding_blocks_stay_within_the_window():
    s = hybrid()
    s.add(TokenizedRequest("a", pack_ids(range(10, 50)),
                           SamplingParams(max_tokens=120, ignore_eos=True)))
    full, sliding = [], []
    while s.has_work():
        step = s.schedule()
        req = step.scheduled[0][0]
        full.append(len(req.tables[0]))
        sliding.append(sum(b >= 0 for b in req.tables[1]))
        finish(s, step)
    # W = 8 keys plus the chunk being computed: never more than a few blocks.
    assert max(sliding[3:]) <= -(-(8 - 1) // 4) + 1
    assert full[-1] == -(-(40 + 120 - 1) // 4)


def test_no_block_leaks_after_thousands_of_random_requests_and_aborts():
    rng = random.Random(0)
    s = hybrid(num_blocks=24, budget=24, chunk=8, max_seqs=6, host=16)
    prefixes = [list(np.random.default_rng(i).integers(3, 500, 20)) for i in range(4)]
    in_flight = []
    live: list[str] = []
    for i in range(2000):
        if rng.random() < 0.6:
            prompt = rng.choice(prefixes)[: rng.randint(1, 20)] + [rng.randint(3, 500)
                                                                for _ in range(rng.randint(1, 12))]
            rid = f"r{i}"
            s.add(TokenizedRequest(rid, pack_ids(prompt), SamplingParams(
                max_tokens=rng.randint(1, 40), ignore_eos=rng.random() < 0.7)))
            live.append(rid)
        if live and rng.random() < 0.1:
            s.abort([live.pop(rng.randrange(len(live)))])
        step = s.schedule()
        if step is not None:
            in_flight.append(step)
        # Overlap: sometimes results lag one step behind the plans.
        while len(in_flight) > (1 if rng.random() < 0.5 else 0):
            finish(s, in_flight.pop(0), token=rng.choice([2, 7, 9]))
    while s.has_work() or in_flight:
        step = s.schedule()
        if step is not None:
            in_flight.append(step)
        while in_flight:
            finish(s, in_flight.pop(0))
    assert s.num_preemptions > 0 and s.kv.cache.hits_tokens > 0
    assert s.stats().host_blocks_out > 0 and s.stats().host_blocks_in > 0
    assert s.kv.num_reusable() == s.kv.num_total()
    s.kv.cache.evict(10**9)
    assert [a.num_free for a in s.kv.allocators] == [24, 24]
