"""The exactness audit's API surface on the fake engine: /metrics and GET /v1/audit (behind the
API key)."""

from __future__ import annotations

from starlette.testclient import TestClient

from deepinfer.engine.protocol import AuditDivergence, SchedulerStats
from deepinfer.frontend.server.app import build_app
from deepinfer.frontend.server.state import ServerState

AUDITED = SchedulerStats(
    audit_requests=7, audit_divergences={"prefix_disk": 2, "batch": 1},
    audit_largest_logprob_diff=0.25, audit_pending=3,
    audit_latest=[AuditDivergence("cmpl-1", ["batch", "prefix_disk"], 4, 0.25, 16),
                  AuditDivergence("cmpl-2", ["prefix_disk"], 0, 0.125, 8)])


def audit_lines(http) -> set[str]:
    return {line for line in http.get("/metrics").text.splitlines()
            if line.startswith("deepinfer_audit")}


def test_metrics_before_any_audit(http):
    assert audit_lines(http) == {
        "deepinfer_audit_requests_total 0.0",
        'deepinfer_audit_divergences_total{shortcut="none"} 0.0',
        "deepinfer_audit_max_logprob_diff 0.0",
        "deepinfer_audit_pending 0.0",
    }
    assert http.get("/v1/audit").json() == {"requests": 0, "pending": 0, "divergences": {},
                                            "max_logprob_diff": 0.0, "latest": []}


def test_divergences_per_shortcut_and_the_latest(http, engine):
    engine.stats = AUDITED
    assert audit_lines(http) == {
        "deepinfer_audit_requests_total 7.0",
        'deepinfer_audit_divergences_total{shortcut="batch"} 1.0',
        'deepinfer_audit_divergences_total{shortcut="none"} 0.0',
        'deepinfer_audit_divergences_total{shortcut="prefix_disk"} 2.0',
        "deepinfer_audit_max_logprob_diff 0.25",
        "deepinfer_audit_pending 3.0",
    }
    body = http.get("/v1/audit").json()
    assert body["requests"] == 7 and body["divergences"] == {"prefix_disk": 2, "batch": 1}
    assert body["latest"][0] == {"request_id": "cmpl-1", "shortcuts": ["batch", "prefix_disk"],
                                 "position": 4, "max_logprob_diff": 0.25, "num_tokens": 16}
    assert [d["request_id"] for d in body["latest"]] == ["cmpl-1", "cmpl-2"]


def test_the_audit_wants_the_api_key(engine):
    engine.stats = AUDITED
    state = ServerState(max_pending=8, api_key="s3cret")
    with TestClient(build_app(state, lambda: engine)) as http:
        assert http.get("/v1/audit").status_code == 401
        ok = http.get("/v1/audit", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["requests"] == 7
