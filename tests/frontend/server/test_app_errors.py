"""The API layer against an in-process fake engine: bad input, bounds, engine failure."""

from __future__ import annotations

import threading

import pytest
from starlette.testclient import TestClient

from deepinfer.frontend.server.app import build_app
from deepinfer.frontend.server.common import lenient
from deepinfer.frontend.server.state import ServerState
from tests.frontend.server.fake_engine import MODEL, FakeEngineClient, chat, sse

BAD = [
    ("chat", b"{not json", 400, None),
    ("chat", {"messages": "hi"}, 400, "messages"),
    ("chat", {"messages": []}, 400, "messages"),
    ("chat", {"max_tokens": "ten"}, 400, "max_tokens"),
    ("chat", {"max_tokens": -1}, 400, "max_tokens"),
    ("chat", {"max_tokens": 0}, 400, "max_tokens"),
    ("chat", {"max_tokens": 10**6}, 400, "max_tokens"),
    ("chat", {"max_completion_tokens": 65}, 400, "max_completion_tokens"),
    ("chat", {"temperature": -0.1}, 400, "temperature"),
    ("chat", {"top_p": 0}, 400, "top_p"),
    ("chat", {"top_p": 1.5}, 400, "top_p"),
    ("chat", {"n": 0}, 400, "n"),
    ("chat", {"n": 1000}, 400, "n"),
    ("chat", {"top_logprobs": 3}, 400, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("chat", {"presence_penalty": 3}, 400, "presence_penalty"),
    ("chat", {"stop": [""]}, 400, "stop"),
    ("chat", {"logit_bias": {"5": 1.0}}, 400, "logit_bias"),
    ("chat", {"response_format": {"type": "xml"}}, 400, "response_format.type"),
    ("chat", {"response_format": {"type": "json_schema"}}, 400, "response_format.json_schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
     "response_format.json_schema.schema"),
    ("chat", {"guided_json": "{not json"}, 400, "guided_json"),
    ("chat", {"guided_json": [1, 2]}, 400, "guided_json"),
    ("chat", {"guided_choice": []}, 400, "guided_choice"),
    ("chat", {"guided_choice": ["a", 3]}, 400, "guided_choice"),
    ("chat", {"guided_regex": ""}, 400, "guided_regex"),
    ("chat", {"guided_regex": "a" * 70000}, 400, "guided_regex"),
    ("chat", {"guided_regex": "a+", "guided_choice": ["a"]}, 400, "guided_choice"),
    ("chat", {"guided_regex": "a+", "guided_decoding_backend": "outlines"}, 400,
     "guided_decoding_backend"),
    ("chat", {"tool_choice": "required"}, 400, "tool_choice"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}],
              "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
     "tool_choice"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}],
              "tool_choice": "required", "guided_regex": "a"}, 400, "tool_choice"),
    ("chat", {"function_call": {"name": "f"}}, 400, "function_call"),
    ("chat", {"guided_regex": "a+", "ignore_eos": True}, 400, "ignore_eos"),
    ("completions", {"prompt": "x", "response_format": {"type": "json_schema",
                                                        "json_schema": {"schema": 5}}}, 400,
     "response_format.json_schema.schema"),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0].type"),
    ("chat", {"messages": [{"role": "user", "content": "x " * 70}]}, 400, "messages"),
    ("chat", {"messages": [{"role": "user", "content": ""}]}, 400, "messages"),
    ("chat", {"model": "gpt-4"}, 404, "model"),
    ("completions", {"prompt": "x " * 70}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": ["a", 1]}, 400, "prompt"),
    ("completions", {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ("completions", {"prompt": "a", "suffix": "b"}, 400, "suffix"),
    ("completions", {}, 400, "prompt"),
]


@pytest.mark.parametrize("endpoint,body,status,param", BAD)
def test_bad_requests(http, endpoint, body, status, param):
    url = f"/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}"
    if isinstance(body, dict):
        if endpoint == "chat":
            body.setdefault("messages", [{"role": "user", "content": "hi"}])
        body.setdefault("model", MODEL)
        r = http.post(url, json=body)
    else:
        r = http.post(url, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert error["type"] == ("invalid_request_error" if status == 400 else error["type"])
    assert error["message"]
    if status == 404:
        assert error["code"] == "model_not_found"
    assert chat(http, max_tokens=1).status_code == 200  # still serving


def test_fields_not_served_are_ignored_and_logged_once(http, caplog):
    """Official fields the Responses endpoint takes (prompt_cache_retention, ...), litellm's
    per-message provider_specific_fields and any unknown field: ignored, logged once each."""
    lenient._logged.clear()
    reply = {"role": "assistant", "content": "a", "provider_specific_fields": {"reasoning": "r"}}
    body = {"prompt_cache_retention": "24h", "prompt_cache_options": {"x": 1},
            "moderation": {"model": "m"}, "foo": 1, "max_tokens": 1,
            "messages": [{"role": "user", "content": "x", "bogus": 1}, reply,
                         {"role": "user", "content": "y"}]}
    with caplog.at_level("WARNING", logger="deepinfer.api"):
        for _ in range(2):
            assert chat(http, **body).status_code == 200
    logged = [r.getMessage() for r in caplog.records if "ignoring the field" in r.getMessage()]
    assert sorted(m.split("field ")[1].split(",")[0] for m in logged) == [
        "foo", "messages[].bogus", "messages[].provider_specific_fields", "moderation",
        "prompt_cache_options", "prompt_cache_retention"]


def test_prompt_too_long_is_400_when_streaming(http):
    r = chat(http, stream=True, messages=[{"role": "user", "content": "x " * 70}])
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_model_alias_accepted(http):
    assert chat(http, model="alias", max_tokens=1).status_code == 200


def test_body_too_large(http):
    big = b'{"prompt": "' + b"a" * (9 << 20) + b'"}'
    r = http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_unknown_route_is_json(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    assert http.get("/v1/chat/completions").status_code == 405


def test_queue_bound_503(http, state):
    state.pending = state.max_pending  # as if 8 requests were running
    r = chat(http, max_tokens=1)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "overloaded"
    state.pending = state.max_pending - 2
    assert chat(http, max_tokens=1, n=3).status_code == 503
    assert chat(http, max_tokens=1, n=2).status_code == 200
    state.pending = 0
    text = http.get("/metrics").text
    assert 'deepinfer_requests_total{endpoint="chat",status="503"} 2.0' in text


def test_engine_failure(http, engine, state):
    engine.fail("worker0 exited (code -9)")
    assert http.get("/health").status_code == 503
    r = chat(http, max_tokens=1)
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    assert state.failure == "worker0 exited (code -9)"


def test_engine_failure_mid_request():
    engine = FakeEngineClient(MODEL, delay=0.01)
    state = ServerState(max_pending=8)
    with TestClient(build_app(state, lambda: engine)) as http:
        threading.Timer(0.05, engine.fail, args=("boom",)).start()
        r = chat(http, max_tokens=60)
        assert r.status_code == 503
        assert "boom" in r.json()["error"]["message"]
    assert engine.stopped
    assert state.pending == 0


def test_engine_failure_mid_stream_is_in_band():
    engine = FakeEngineClient(MODEL, delay=0.01)
    state = ServerState(max_pending=8)
    with TestClient(build_app(state, lambda: engine)) as http:
        threading.Timer(0.05, engine.fail, args=("boom",)).start()
        r = chat(http, max_tokens=60, stream=True)
        assert r.status_code == 200
        events = sse(r)
        assert "boom" in events[-1]["error"]["message"]
        assert events[-1]["error"]["type"] == "server_error"
    assert state.pending == 0




def test_a_client_gone_while_sending_its_body_is_499_not_500(state):
    import asyncio

    from starlette.requests import ClientDisconnect, Request

    from deepinfer.frontend.server.app import _route

    async def handler(state, request):
        raise ClientDisconnect()

    endpoint = _route(state, "chat", handler)
    response = asyncio.run(endpoint(Request({"type": "http", "method": "POST", "headers": []})))
    assert response.status_code == 499
    assert state.metrics.requests.labels("chat", "499")._value.get() == 1
