"""/v1/responses through the app against the in-process fake engine: the stored conversation
a continuation's prompt is built from, the store's routes, errors in OpenAI's shape, the
metrics label, and an engine failure mid-stream as `response.failed`."""

from __future__ import annotations

import json
import threading

from starlette.testclient import TestClient

from deepinfer.frontend.server.app import build_app
from deepinfer.frontend.server.state import ServerState
from tests.frontend.server.fake_engine import MODEL, FakeEngineClient


def create(http, **body):
    body.setdefault("model", MODEL)
    body.setdefault("max_output_tokens", 2)
    return http.post("/v1/responses", json=body)


def events(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ")]


def test_a_continuation_runs_on_the_stored_conversation(http, engine):
    first = create(http, input="hello there", instructions="be kind").json()
    assert first["id"].startswith("resp_") and first["output"][0]["content"][0]["text"] == \
        " w0 w1"
    second = create(http, input="and", previous_response_id=first["id"])
    assert second.status_code == 200, second.text
    # The earlier turn and its answer come first; its instructions are not carried over.
    assert [(m.role, m.content) for m in engine.requests[-1].messages] == [
        ("user", "hello there"), ("assistant", " w0 w1"), ("user", "and")]
    third = create(http, input="so", previous_response_id=second.json()["id"])
    assert [m.content for m in engine.requests[-1].messages] == [
        "hello there", " w0 w1", "and", " w0 w1", "so"]
    assert third.json()["previous_response_id"] == second.json()["id"]


def test_get_and_delete_a_stored_response(http):
    body = create(http, input="hello there").json()
    assert http.get(f"/v1/responses/{body['id']}").json() == body
    assert http.delete(f"/v1/responses/{body['id']}").json() == {
        "id": body["id"], "deleted": True, "object": "response.deleted"}
    for r in (http.get(f"/v1/responses/{body['id']}"),
              http.delete(f"/v1/responses/{body['id']}")):
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    text = http.get("/metrics").text
    assert 'deepinfer_requests_total{endpoint="responses",status="404"} 2.0' in text


def test_store_false_keeps_nothing(http):
    body = create(http, input="hello there", store=False).json()
    assert body["store"] is False
    assert http.get(f"/v1/responses/{body['id']}").status_code == 404


def test_errors_name_the_field(http):
    r = create(http, input="hi", previous_response_id="resp_unknown")
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    r = create(http, input="hi", temperature="hot")
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = create(http, input="hi", max_output_tokens=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"
    r = create(http, input=[])
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    r = create(http, input="hi", model="other")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_an_engine_failure_mid_stream_is_response_failed():
    engine = FakeEngineClient(MODEL, delay=0.01)
    state = ServerState(max_pending=8)
    with TestClient(build_app(state, lambda: engine)) as http:
        threading.Timer(0.05, engine.fail, args=("boom",)).start()
        r = create(http, input="hello", max_output_tokens=60, stream=True)
        assert r.status_code == 200
        last = events(r)[-1]
        assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
        assert last["response"]["error"]["code"] == "server_error"
        assert "boom" in last["response"]["error"]["message"]
        assert http.get(f"/v1/responses/{last['response']['id']}").status_code == 404
    assert state.pending == 0
