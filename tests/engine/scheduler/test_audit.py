"""The exactness audit in the scheduler (engine/scheduler/audit.py) against a fake model whose
tokens and logprobs are a function of each request's tokens: a cold re-run must reproduce them,
and a fault planted in one shortcut (a prefix hit moving the logprobs) must be counted under it."""

from __future__ import annotations

import pytest

from deepinfer.engine.protocol import (
    FinishReason,
    SampledLogprobs,
    SamplingParams,
    StepPlan,
    StepResult,
    TokenizedRequest,
    pack_ids,
    unpack_ids,
)
from deepinfer.engine.scheduler.audit import AUDIT_PREFIX, compare
from deepinfer.engine.scheduler.scheduler import Scheduler, SchedulerConfig


class FakeModel:
    """Next token and its logprob from the request's tokens so far; `hit_bias` is added to the
    logprobs of a request whose first computed position was not 0 (it started from a prefix
    hit): a shortcut that silently changes answers."""

    def __init__(self, hit_bias: float = 0.0) -> None:
        self.hit_bias = hit_bias
        self.tokens: dict[str, list[int]] = {}
        self.wants: dict[str, bool] = {}
        self.hit: dict[str, bool] = {}

    def step(self, plan: StepPlan) -> StepResult:
        for info in plan.new_requests:
            self.tokens[info.request_id] = unpack_ids(info.prompt_ids).tolist()
            self.wants[info.request_id] = info.params.logprobs is not None
        sampled, logprobs = [], []
        for seq in plan.seqs:
            rid = seq.request_id
            self.hit.setdefault(rid, seq.start_pos > 0)
            if not seq.sample:
                continue
            history = self.tokens[rid]
            token = (sum(history) * 31 + len(history)) % 50 + 3
            lp = -((sum(history) * 17) % 97) / 100 - (self.hit_bias if self.hit[rid] else 0.0)
            history.append(token)
            sampled.append(token)
            logprobs.append(SampledLogprobs(token, lp) if self.wants[rid] else None)
        if not any(logprobs):
            logprobs = []
        return StepResult(plan.step_id, pack_ids(sampled), logprobs)


def make(rate: float = 1.0, **kw) -> Scheduler:
    kw = {"audit_idle_seconds": 0.0, **kw}
    return Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_batched_tokens=64,
                                     prefill_chunk_size=16, eos_token_ids=(2,), audit_rate=rate,
                                     **kw))


def add(s: Scheduler, rid: str, prompt: list[int], **params) -> None:
    params = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True, **params}
    assert s.add(TokenizedRequest(rid, pack_ids(prompt), SamplingParams(**params))) is None


def drive(s: Scheduler, model: FakeModel, limit: int = 500):
    """Steps until the scheduler has nothing left: (deltas, plans)."""
    deltas, plans = [], []
    for _ in range(limit):
        step = s.schedule()
        if step is None:
            break
        plans.append(step.plan)
        deltas += s.update(step, model.step(step.plan))
    return deltas, plans


PROMPT = list(range(10, 30))


def test_a_cold_rerun_reproduces_the_request_and_nothing_of_it_reaches_a_client():
    s, model = make(), FakeModel()
    add(s, "a", PROMPT)
    deltas, plans = drive(s, model)
    assert s.audit.requests == 1 and s.audit.divergences == {}
    assert all(not d.request_id.startswith(AUDIT_PREFIX) for d in deltas)
    assert all(not d.logprobs for d in deltas)  # computed for the audit, never sent
    runs = [p for p in plans if any(q.request_id.startswith(AUDIT_PREFIX) for q in p.seqs)]
    assert runs and all(len(p.seqs) == 1 for p in runs)  # its own batch
    rerun = next(p for p in runs if p.new_requests).new_requests[0]
    assert unpack_ids(rerun.prompt_ids).tolist() == PROMPT
    assert rerun.params.max_tokens == 6 and not rerun.params.speculative
    stats = s.stats()
    assert stats.audit_requests == 1 and stats.audit_pending == 0 and not stats.audit_latest


def test_the_rerun_computes_the_whole_prompt_and_caches_nothing():
    cached = []
    for rate in (0.0, 1.0):
        s, model = make(rate), FakeModel()
        add(s, "a", PROMPT)
        drive(s, model)
        add(s, "b", PROMPT + [40, 41, 42, 43])  # a prefix hit on a's blocks
        _, plans = drive(s, model)
        cached.append((s.kv.cache.num_cached_blocks, s.kv.cache.hits_tokens))
    rerun = [q for p in plans for q in p.seqs if q.request_id.startswith(AUDIT_PREFIX)]
    assert rerun[0].start_pos == 0  # no prefix match, though b's prefix is cached
    assert s.audit.requests == 2 and s.audit.divergences == {}
    assert cached[0] == cached[1]  # the reruns neither inserted nor matched a block


def test_a_shortcut_that_moves_logprobs_is_counted_under_it():
    s, model = make(), FakeModel(hit_bias=0.01)
    add(s, "a", PROMPT)
    drive(s, model)
    add(s, "b", PROMPT + [40, 41, 42, 43])
    drive(s, model)
    assert s.audit.requests == 2
    assert s.audit.divergences == {"prefix_device": 1}
    (found,) = s.stats().audit_latest
    assert found.request_id == "b" and found.shortcuts == ["prefix_device"]
    assert found.position == 0 and found.max_logprob_diff == pytest.approx(0.01)


def test_a_request_that_asked_for_logprobs_still_gets_them():
    s, model = make(), FakeModel()
    add(s, "a", PROMPT, logprobs=0)
    deltas, _ = drive(s, model)
    assert sum(len(d.logprobs) for d in deltas) == 6 and s.audit.requests == 1


def test_live_traffic_ends_a_rerun_which_starts_again_when_idle():
    s, model = make(), FakeModel()
    add(s, "a", PROMPT)
    for _ in range(20):  # a runs to its end; the rerun begins
        step = s.schedule()
        s.update(step, model.step(step.plan))
        if s.audit.run is not None:
            break
    assert s.audit.run is not None
    add(s, "b", [5, 6, 7])
    step = s.schedule()
    assert [q.request_id for q in step.plan.seqs] == ["b"]  # the rerun is gone from the batch
    assert s.audit.run is None and len(s.audit.jobs) == 1
    assert any(rid.startswith(AUDIT_PREFIX) for rid in step.plan.finished)  # workers forget it
    s.update(step, model.step(step.plan))
    drive(s, model)
    assert s.audit.requests == 2 and s.audit.divergences == {}


def test_sampled_requests_get_a_seed_and_unpicked_ones_are_left_alone():
    s = make(rate=0.0)
    add(s, "a", PROMPT, temperature=1.0)
    assert s.requests["a"].params.seed is None and s.requests["a"].params.logprobs is None
    s = make(rate=1.0)
    add(s, "a", PROMPT, temperature=1.0)
    assert s.requests["a"].params.seed is not None
    add(s, "b", PROMPT, temperature=1.0, seed=5)
    assert s.requests["b"].params.seed == 5


def test_aborted_requests_are_not_audited():
    s, model = make(), FakeModel()
    add(s, "a", PROMPT)
    step = s.schedule()
    s.update(step, model.step(step.plan))
    s.abort(["a"], FinishReason.ABORT)
    drive(s, model)
    assert s.audit.requests == 0 and not s.audit.jobs


def test_compare_finds_the_first_difference():
    assert compare([1, 2, 3], [-1, -2, -3], [1, 2, 3], [-1, -2, -3], 0.0) == (None, 0.0)
    assert compare([1, 2, 3], [-1, -2, -3], [1, 9, 3], [-1, -2.5, -3], 0.0) == (1, 0.5)
    assert compare([1, 2], [-1, -2], [1, 2, 3], [-1, -2, -3], 0.0) == (2, 0.0)
    first, gap = compare([1, 2], [-1.0, -2.0], [1, 2], [-1.0, -2.0 + 1e-6], 1e-3)
    assert first is None and gap == pytest.approx(1e-6)
    assert compare([1, 2], [-1.0, -2.0], [1, 2], [-1.0, -2.0 + 1e-6], 0.0)[0] == 1


def test_a_rerun_waits_until_the_server_was_idle_for_a_while():
    """A client sending requests back to back leaves gaps of milliseconds: no re-run starts in
    them; the loop is woken when the idle time is up (connector_deadline)."""
    import time

    s, model = make(audit_idle_seconds=0.2), FakeModel()
    add(s, "a", PROMPT)
    drive(s, model)  # a finishes; the re-run waits
    assert s.audit.run is None and len(s.audit.jobs) == 1
    wake = s.connector_deadline()
    assert wake is not None and 0.1 < wake - time.monotonic() <= 0.2
    time.sleep(0.25)
    drive(s, model)
    assert s.audit.requests == 1


def test_a_job_names_the_shortcuts_its_request_took():
    s, model = make(audit_idle_seconds=60.0, audit_server_shortcuts=("kv_float16",)), FakeModel()
    add(s, "a", PROMPT)
    drive(s, model)
    add(s, "b", PROMPT + [40, 41, 42, 43])  # a prefix hit on a's blocks...
    add(s, "c", [5, 6, 7])  # ... in a step shared with c
    drive(s, model)
    jobs = {job.request_id: job.shortcuts for job in s.audit.jobs}
    assert jobs == {"a": ("kv_float16",), "b": ("batch", "kv_float16", "prefix_device"),
                    "c": ("batch", "kv_float16")}
