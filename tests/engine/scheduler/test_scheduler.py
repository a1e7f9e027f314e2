"""Scheduler decisions with a hand-made config: no model, no processes."""

from __future__ import annotations

from deepinfer.engine.protocol import (
    FinishReason,
    SamplingParams,
    StepResult,
    TokenizedRequest,
    pack_ids,
    unpack_ids,
)
from deepinfer.engine.scheduler.scheduler import Scheduler, SchedulerConfig


def make(num_blocks=64, block_size=4, budget=32, chunk=16, max_seqs=8, ctx=1024, eos=(2,)):
    return Scheduler(SchedulerConfig(num_blocks, block_size, max_seqs, budget, chunk, ctx, eos,
                                     prefix_caching=False))


def add(s: Scheduler, rid: str, n: int, **params) -> None:
    err = s.add(TokenizedRequest(rid, pack_ids(list(range(10, 10 + n))),
                                 SamplingParams(**params)))
    assert err is None


def run_step(s: Scheduler, token: int = 7):
    step = s.schedule()
    assert step is not None
    n_sample = sum(seq.sample for _, seq in step.scheduled)
    deltas = s.update(step, StepResult(step.plan.step_id, pack_ids([token] * n_sample)))
    return step, deltas


def test_chunked_prefill_respects_budget_and_chunk():
    s = make(budget=20, chunk=8)
    add(s, "a", 30, max_tokens=4)
    add(s, "b", 5, max_tokens=4)
    step, deltas = run_step(s)
    sizes = {seq.request_id: len(unpack_ids(seq.token_ids)) for _, seq in step.scheduled}
    assert sizes == {"a": 8, "b": 5}
    assert sum(sizes.values()) <= 20
    # b's whole prompt fit: it is sampled; a is mid-prefill: not sampled.
    assert [d.request_id for d in deltas] == ["b"]
    assert [seq.start_pos for _, seq in step.scheduled] == [0, 0]


def test_decodes_go_first_then_prefill_chunks():
    s = make(budget=10, chunk=8)
    add(s, "a", 3, max_tokens=10)
    run_step(s)  # a prefilled, now decoding
    add(s, "b", 20, max_tokens=4)
    step, _ = run_step(s)
    order = [(seq.request_id, len(unpack_ids(seq.token_ids))) for _, seq in step.scheduled]
    assert order == [("a", 1), ("b", 8)]
    assert step.plan.seqs[0].start_pos == 3


def test_admission_is_bounded_by_free_blocks_and_max_seqs():
    s = make(num_blocks=4, block_size=4, budget=100, chunk=100, max_seqs=8)
    add(s, "a", 10)  # 3 blocks
    add(s, "b", 10)  # would need 3 more: only 1 free
    step = s.schedule()
    assert [seq.request_id for _, seq in step.scheduled] == ["a"]
    assert len(s.waiting) == 1
    s2 = make(max_seqs=2)
    for rid in "xyz":
        add(s2, rid, 2)
    assert len(s2.schedule().scheduled) == 2


def test_preemption_frees_newest_and_recomputes_it():
    s = make(num_blocks=4, block_size=4, budget=64, chunk=64)
    add(s, "old", 4, max_tokens=20, ignore_eos=True)  # 1 block, then grows
    add(s, "new", 8, max_tokens=20, ignore_eos=True)  # 2 blocks
    run_step(s)
    assert s.allocator.num_free == 1
    for _ in range(4):  # old needs a 2nd block at 5 tokens, new a 3rd at 9: one must go
        run_step(s)
    assert s.num_preemptions >= 1
    new = s.requests["new"]
    assert new.output_ids and new.num_computed <= new.num_tokens
    # The preempted request comes back and recomputes its prompt and outputs.
    while s.has_work():
        run_step(s)
    assert s.allocator.num_free == 4


def test_finish_on_eos_stop_ids_and_length():
    s = make()
    add(s, "eos", 3, max_tokens=10)
    add(s, "stopid", 3, max_tokens=10, stop_token_ids=[7], ignore_eos=True)
    add(s, "len", 3, max_tokens=2, ignore_eos=True)
    _, deltas = run_step(s, token=2)
    reasons = {d.request_id: d.finish_reason for d in deltas}
    assert reasons["eos"] == FinishReason.STOP
    assert reasons["stopid"] is None and reasons["len"] is None
    step2, deltas = run_step(s, token=7)
    reasons = {d.request_id: d.finish_reason for d in deltas}
    assert reasons == {"stopid": FinishReason.STOP, "len": FinishReason.LENGTH}
    assert not s.has_work() and s.allocator.num_free == 64
    # the workers hear about finished requests in the next plan
    assert step2.plan.finished == ["eos"]
    add(s, "next", 2)
    assert set(s.schedule().plan.finished) == {"stopid", "len"}


def test_abort_frees_blocks_and_tells_workers():
    s = make()
    add(s, "a", 9, max_tokens=50)
    run_step(s)
    assert s.allocator.num_free < 64
    s.abort(["a", "unknown"])
    assert s.allocator.num_free == 64 and not s.has_work()
    add(s, "b", 2)
    assert s.schedule().plan.finished == ["a"]


def test_context_length_finishes_with_length_and_rejects_long_prompts():
    s = make(ctx=8)
    err = s.add(TokenizedRequest("long", pack_ids(list(range(8))), SamplingParams()))
    assert err is not None and err.finish_reason == FinishReason.ERROR and "8 tokens" in err.error
    add(s, "a", 6, max_tokens=100, ignore_eos=True)
    _, d1 = run_step(s)
    _, d2 = run_step(s)
    assert d1[0].finish_reason is None and d2[0].finish_reason == FinishReason.LENGTH


def test_new_requests_are_sent_to_workers_once():
    s = make()
    add(s, "a", 3, max_tokens=3)
    step1, _ = run_step(s)
    step2, _ = run_step(s)
    assert [r.request_id for r in step1.plan.new_requests] == ["a"]
    assert step2.plan.new_requests == []


def test_overlap_placeholder_then_results_in_order():
    s = make()
    add(s, "a", 3, max_tokens=3, ignore_eos=True)
    step1 = s.schedule()  # prefill, samples token 1
    step2 = s.schedule()  # planned before step1's result: decode on the placeholder
    [(_, seq2)] = step2.scheduled
    assert seq2.token_ids == b"" and seq2.start_pos == 3 and seq2.sample
    s.update(step1, StepResult(step1.plan.step_id, pack_ids([11])))
    step3 = s.schedule()  # token 2 still in flight, token 3 would be the last: plan it
    s.update(step2, StepResult(step2.plan.step_id, pack_ids([12])))
    deltas = s.update(step3, StepResult(step3.plan.step_id, pack_ids([13])))
    assert s.requests == {} and deltas[0].finish_reason == FinishReason.LENGTH
    assert s.schedule() is None  # max_tokens reached: nothing planned past it
    assert s.allocator.num_free == 64


def test_overlap_drops_the_token_after_eos():
    s = make()
    add(s, "a", 3, max_tokens=10)
    step1 = s.schedule()
    step2 = s.schedule()
    d1 = s.update(step1, StepResult(step1.plan.step_id, pack_ids([2])))  # EOS
    assert d1[0].finish_reason == FinishReason.STOP
    assert s.update(step2, StepResult(step2.plan.step_id, pack_ids([9]))) == []
    assert s.allocator.num_free == 64


def test_max_loras_bounds_the_adapters_of_a_batch_without_blocking_others():
    from dataclasses import replace

    s = make(budget=100, chunk=100)
    s.config = replace(s.config, lora_salts={"a": 1, "b": 2}, max_loras=1)
    add(s, "a1", 3, max_tokens=2, lora="a")
    add(s, "b1", 3, max_tokens=2, lora="b")  # another adapter: no room while a1 runs
    add(s, "base", 3, max_tokens=2)  # the base model takes no adapter slot
    add(s, "a2", 3, max_tokens=2, lora="a")
    step, _ = run_step(s)
    assert [seq.request_id for _, seq in step.scheduled] == ["a1", "base", "a2"]
    assert [r.request_id for r in s.waiting] == ["b1"]  # still first in line
    run_step(s)  # a1, a2 and base generate their last token
    step, _ = run_step(s)
    assert [seq.request_id for _, seq in step.scheduled] == ["b1"]
