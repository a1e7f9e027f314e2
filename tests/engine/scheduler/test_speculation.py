"""Draft slots, multi-token results and their bookkeeping in the scheduler, with no model."""

from __future__ import annotations

from deepinfer.engine.protocol import SamplingParams, StepResult, TokenizedRequest, pack_ids
from deepinfer.engine.scheduler.scheduler import Scheduler, SchedulerConfig

EOS = 2


def make(k=3, budget=64, blocks=64, disable=None, ctx=256) -> Scheduler:
    return Scheduler(SchedulerConfig(
        num_blocks=blocks, block_size=4, max_num_batched_tokens=budget, prefill_chunk_size=64,
        context_len=ctx, eos_token_ids=(EOS,), num_speculative_tokens=k,
        speculative_disable_by_batch_size=disable))


def add(s: Scheduler, rid: str, n: int = 6, **params) -> None:
    params.setdefault("max_tokens", 50)
    assert s.add(TokenizedRequest(rid, pack_ids(range(10, 10 + n)),
                                  SamplingParams(**params))) is None


def result(step, per_seq: dict[str, tuple[list[int], int]]) -> StepResult:
    """per_seq: request id -> (new tokens, drafts proposed); others get one token 7."""
    tokens, counts, drafts = [], [], []
    for _, seq in step.scheduled:
        if seq.sample:
            new, proposed = per_seq.get(seq.request_id, ([7], 0))
            tokens += new
            counts.append(len(new))
            drafts.append(proposed)
    return StepResult(step.plan.step_id, pack_ids(tokens), num_sampled=pack_ids(counts),
                      num_drafts=pack_ids(drafts))


def prefill(s: Scheduler) -> None:
    """Until every request has its first output token."""
    while any(not r.output_ids for r in s.requests.values()):
        step = s.schedule()
        s.update(step, result(step, {}))


def test_a_decode_gets_draft_slots_and_keeps_accepted_tokens():
    s = make(k=3)
    add(s, "a")
    prefill(s)  # 6 prompt tokens computed, one output token
    step = s.schedule()
    seq = step.plan.seqs[0]
    assert seq.draft_slots == 3 and seq.start_pos == 6
    assert len(s.requests["a"].tables[0]) * 4 >= 6 + 1 + 3  # slots for the drafts reserved
    deltas = s.update(step, result(step, {"a": ([20, 21, 22], 3)}))  # 2 drafts kept + 1
    req = s.requests["a"]
    assert list(req.output_ids) == [7, 20, 21, 22] and req.num_computed == 6 + 1 + 2
    assert len(req.tables[0]) == 3  # 11 tokens: the fourth block (rejected slot) went back
    assert deltas[0].token_ids == pack_ids([20, 21, 22])
    assert (s.spec.draft_tokens, s.spec.accepted_tokens) == (3, 2)
    assert s.spec.accepted_by_position == [1, 1, 0]


def test_draft_slots_respect_max_tokens_context_and_budget():
    s = make(k=5, budget=4, ctx=12)
    add(s, "a", n=6, max_tokens=4)
    prefill(s)
    assert s.schedule().plan.seqs[0].draft_slots == 2  # 3 tokens left: 2 drafts + 1
    s = make(k=5, ctx=10)
    add(s, "b", n=6, max_tokens=50)
    prefill(s)
    assert s.schedule().plan.seqs[0].draft_slots == 2  # 7 tokens known, 10 at most


def test_eos_inside_an_accepted_run_ends_the_request_there():
    s = make(k=4)
    add(s, "a", max_tokens=50)
    prefill(s)
    step = s.schedule()
    deltas = s.update(step, result(step, {"a": ([30, EOS, 31, 32], 4)}))
    assert deltas[0].token_ids == pack_ids([30, EOS]) and deltas[0].finish_reason == 1
    assert "a" not in s.requests
    assert s.kv.num_reusable() == s.kv.num_total()


def test_max_tokens_inside_an_accepted_run_ends_the_request_there():
    s = make(k=4)
    add(s, "a", max_tokens=3, ignore_eos=True)
    prefill(s)
    step = s.schedule()
    assert step.plan.seqs[0].draft_slots == 1  # 1 token out, 2 to go: 1 draft + 1
    deltas = s.update(step, result(step, {"a": ([30, 31], 1)}))
    assert deltas[0].token_ids == pack_ids([30, 31]) and deltas[0].finish_reason == 2


def test_a_miss_backs_off_then_tries_again():
    s = make(k=3)
    add(s, "a")
    prefill(s)
    slots = []
    for _ in range(8):
        step = s.schedule()
        slots.append(step.plan.seqs[0].draft_slots)
        s.update(step, result(step, {}))  # the proposer never finds anything
    assert slots == [3, 0, 3, 0, 0, 3, 0, 0]  # backoff 1, then 2, then 4 steps


def test_overlapped_plain_decodes_count_the_backoff_down():
    """The scheduler process overlaps plain decodes (a token is always in flight) and waits
    only when the next step could speculate: a backed-off request must still get back to
    speculating, or one that missed twice would never speculate again."""
    s = make(k=3)
    add(s, "a", max_tokens=200)
    prefill(s)
    in_flight, slots = None, []
    for _ in range(60):  # the loop of engine/scheduler/scheduler_process.py
        if in_flight is not None and (in_flight.speculative or s.wants_speculation()):
            s.update(in_flight, result(in_flight, {}))  # every proposal misses
            in_flight = None
        step = s.schedule()
        slots.append(step.plan.seqs[0].draft_slots)
        if in_flight is not None:
            s.update(in_flight, result(in_flight, {}))
        in_flight = step
    tries = [i for i, k in enumerate(slots) if k]
    assert len(tries) >= 5 and max(b - a for a, b in zip(tries, tries[1:])) <= 17, slots


def test_no_speculation_above_the_batch_size_limit_or_when_opted_out():
    s = make(k=3, disable=1)
    add(s, "a")
    add(s, "b")
    prefill(s)
    assert [seq.draft_slots for seq in s.schedule().plan.seqs] == [0, 0]
    s = make(k=3)
    add(s, "a", speculative=False)
    prefill(s)
    assert not s.wants_speculation()
    assert s.schedule().plan.seqs[0].draft_slots == 0


def test_nothing_is_planned_for_a_request_whose_speculating_step_is_in_flight():
    s = make(k=3)
    add(s, "a")
    add(s, "b", n=40)
    prefill(s)
    first = s.schedule()
    assert first.speculative
    second = s.schedule()  # planned before the first result: a must sit this one out
    assert [seq.request_id for seq in (second.plan.seqs if second else [])] in ([], ["b"])
    s.update(first, result(first, {"a": ([40, 41], 3)}))
    if second is not None:
        s.update(second, result(second, {}))
    assert s.requests["a"].num_computed == s.requests["a"].num_tokens - 1
