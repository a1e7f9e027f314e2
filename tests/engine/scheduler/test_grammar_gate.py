"""Structured requests wait for their grammar: nothing is scheduled before the workers say it
compiled, a refusal is an error delta (before any token), an abort while compiling leaves
nothing behind."""

from __future__ import annotations

from deepinfer.engine.protocol import FinishReason, GrammarSpec, SamplingParams
from tests.engine.scheduler.test_scheduler import add, make, run_step

REGEX = GrammarSpec("regex", "[ab]+")


def test_nothing_runs_until_the_grammar_is_ready():
    s = make()
    add(s, "g", 5, max_tokens=3, grammar=REGEX)
    add(s, "plain", 5, max_tokens=3)
    step, _ = run_step(s)
    assert [seq.request_id for _, seq in step.scheduled] == ["plain"]
    assert s.stats().num_waiting == 1  # the compiling request counts as waiting
    assert s.grammar_ready("g", None).token_ids == b""  # the tokenizer's go-ahead
    step, _ = run_step(s)
    assert "g" in [seq.request_id for _, seq in step.scheduled]
    assert [n.request_id for n in step.plan.new_requests] == ["g"]


def test_a_refused_grammar_is_an_error_and_frees_the_request():
    s = make()
    add(s, "g", 5, grammar=REGEX)
    delta = s.grammar_ready("g", "invalid regex: nope")
    assert delta.finish_reason == FinishReason.ERROR and delta.error == "invalid regex: nope"
    assert not s.requests and not s.has_work()
    add(s, "next", 3)
    step, _ = run_step(s)
    assert step.plan.finished == ["g"]  # the workers drop its compiled grammar


def test_abort_while_compiling():
    s = make()
    add(s, "g", 5, grammar=REGEX)
    s.abort(["g"])
    assert s.grammar_ready("g", None) is None  # the answer comes too late: ignored
    assert not s.requests and s.stats().num_waiting == 0
    add(s, "next", 3)
    step, _ = run_step(s)
    assert step.plan.finished == ["g"]


def test_params_carry_the_grammar_to_the_workers():
    s = make()
    add(s, "g", 5, grammar=REGEX)
    s.grammar_ready("g", None)
    step, _ = run_step(s)
    assert step.plan.new_requests[0].params == SamplingParams(grammar=REGEX)
