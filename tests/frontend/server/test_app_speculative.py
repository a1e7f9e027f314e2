"""Speculative decoding's API surface on the fake engine: the per-request opt-out and /metrics."""

from __future__ import annotations

import pytest

from deepinfer.engine.protocol import SchedulerStats
from tests.frontend.server.fake_engine import MODEL, chat

SPEC_STATS = SchedulerStats(
    spec_verify_steps=10, spec_draft_tokens=30, spec_accepted_tokens=18,
    spec_drafts_by_position=[10, 10, 10], spec_accepted_by_position=[9, 6, 3],
)


def metric_lines(http) -> set[str]:
    return {line for line in http.get("/metrics").text.splitlines()
            if line.startswith("deepinfer_spec_decode")}


@pytest.mark.parametrize("extra,expected", [({}, True), ({"speculative_decoding": None}, True),
                                            ({"speculative_decoding": True}, True),
                                            ({"speculative_decoding": False}, False)])
def test_opt_out_reaches_the_engine(http, engine, extra, expected):
    assert chat(http, max_tokens=2, **extra).status_code == 200
    body = {"model": MODEL, "prompt": "a b", "max_tokens": 2, **extra}
    assert http.post("/v1/completions", json=body).status_code == 200
    assert [r.params.speculative for r in engine.requests] == [expected, expected]


def test_opt_out_must_be_a_bool(http, engine):
    r = chat(http, speculative_decoding="off")
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculative_decoding"
    assert engine.requests == []


def test_spec_counters_per_position_and_acceptance_rate(http, engine):
    engine.stats = SPEC_STATS
    assert metric_lines(http) == {
        "deepinfer_spec_decode_draft_tokens_total 30.0",
        "deepinfer_spec_decode_accepted_tokens_total 18.0",
        "deepinfer_spec_decode_verify_steps_total 10.0",
        'deepinfer_spec_decode_draft_tokens_per_position_total{position="0"} 10.0',
        'deepinfer_spec_decode_draft_tokens_per_position_total{position="1"} 10.0',
        'deepinfer_spec_decode_draft_tokens_per_position_total{position="2"} 10.0',
        'deepinfer_spec_decode_accepted_tokens_per_position_total{position="0"} 9.0',
        'deepinfer_spec_decode_accepted_tokens_per_position_total{position="1"} 6.0',
        'deepinfer_spec_decode_accepted_tokens_per_position_total{position="2"} 3.0',
        "deepinfer_spec_decode_acceptance_rate 0.6",
    }


def test_spec_counters_are_zero_without_speculation(http):
    # No drafts yet: totals at 0, the rate 0 (not NaN), no per-position series.
    assert metric_lines(http) == {
        "deepinfer_spec_decode_draft_tokens_total 0.0",
        "deepinfer_spec_decode_accepted_tokens_total 0.0",
        "deepinfer_spec_decode_verify_steps_total 0.0",
        "deepinfer_spec_decode_acceptance_rate 0.0",
    }
