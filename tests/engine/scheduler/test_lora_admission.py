"""The scheduler's LoRA side with a real disk tier and its block files: --max-loras bounds the
adapters of a batch even for requests whose prefix is read back from disk while others run, and
a step whose adapter the workers could not read back fails that adapter's requests alone."""

from __future__ import annotations

from dataclasses import replace

from deepinfer.engine.protocol import (
    FinishReason,
    SamplingParams,
    StepResult,
    TokenizedRequest,
    pack_ids,
)
from deepinfer.engine.request import Status
from deepinfer.engine.scheduler.scheduler import Scheduler
from tests.engine.kvcache.test_disk_tier import FakeWorker, make, run

SALTS = {"a": 11, "b": 22}


def lora_scheduler(root) -> tuple[Scheduler, FakeWorker]:
    sched, worker = make(root)
    sched.config = replace(sched.config, lora_salts=SALTS, max_loras=1)
    return sched, worker


def add(sched: Scheduler, rid: str, prompt: list[int], lora: str | None) -> None:
    err = sched.add(TokenizedRequest(rid, pack_ids(prompt), SamplingParams(
        max_tokens=2, ignore_eos=True, lora=lora)))
    assert err is None


def test_a_request_resumed_from_disk_counts_toward_max_loras(tmp_path):
    prompt = list(range(100, 121))  # 5 full blocks and one token
    sched, worker = lora_scheduler(tmp_path)
    add(sched, "a0", prompt, "a")
    run(sched, worker)  # a's blocks reach disk
    sched, worker = lora_scheduler(tmp_path)  # a restarted server: the prefix is on disk only
    add(sched, "a1", prompt + [5, 6], "a")
    plan = sched.schedule()
    assert sched.requests["a1"].status == Status.LOADING
    worker.step(plan)
    sched.update(plan, StepResult(plan.plan.step_id, b""))
    add(sched, "b1", [7, 8, 9], "b")  # another adapter, while a1's blocks are being read
    plan = sched.schedule()
    assert plan is None or not plan.scheduled  # b1 waits: a1 holds the one adapter slot
    if plan is not None:
        worker.step(plan)
        sched.update(plan, StepResult(plan.plan.step_id, b""))
    worker.finish_loads()  # a1 resumes
    adapters = set()
    for _ in range(100):
        plan = sched.schedule()
        if plan is None:
            break
        batch = {req.params.lora for req, _ in plan.scheduled} - {None}
        assert len(batch) <= 1, batch
        adapters |= batch
        worker.step(plan)
        n = sum(seq.sample for _, seq in plan.scheduled)
        sched.update(plan, StepResult(plan.plan.step_id, pack_ids([7] * n)))
    assert adapters == {"a", "b"} and not sched.has_work()


def test_an_adapter_the_workers_cannot_read_back_fails_its_requests_alone(tmp_path):
    sched, worker = lora_scheduler(tmp_path)
    sched.config = replace(sched.config, max_loras=None)
    add(sched, "a1", list(range(100, 109)), "a")
    add(sched, "base", list(range(200, 209)), None)
    plan = sched.schedule()
    worker.step(plan)
    deltas = sched.update(plan, StepResult(plan.plan.step_id, pack_ids([7, 7]),
                                           lora_errors={"a": "/x: files gone"}))
    by_id = {d.request_id: d for d in deltas}
    assert by_id["a1"].finish_reason == FinishReason.ERROR
    assert "'a' cannot be served: /x: files gone" in by_id["a1"].error
    assert by_id["base"].error is None and "a1" not in sched.requests
    run(sched, worker)
    add(sched, "a2", list(range(100, 109)), "a")  # a1's KV was computed without a: not kept
    plan = sched.schedule()
    assert [req.request_id for req, _ in plan.scheduled] == ["a2"]
    assert plan.scheduled[0][1].start_pos == 0
