"""The API layer against an in-process fake engine: response formats and parameters."""

from __future__ import annotations

from starlette.testclient import TestClient

from deepinfer.frontend.server.app import build_app
from tests.frontend.server.fake_engine import MODEL, chat, sse


def test_models_health_version_metrics(http, engine):
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    assert models["data"][0]["max_model_len"] == 64
    assert http.get("/health").status_code == 200
    assert "version" in http.get("/version").json()
    text = http.get("/metrics").text
    assert "deepinfer_kv_blocks_total 100.0" in text
    assert "deepinfer_requests_in_flight 0.0" in text


def test_chat_non_streaming(http, engine):
    r = chat(http, max_tokens=3, temperature=0)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": " w0 w1 w2", "refusal": None}
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert body["usage"]["prompt_tokens"] == 2
    assert body["usage"]["completion_tokens"] == 3
    assert body["usage"]["total_tokens"] == 5
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert (body["usage"]["prompt_cache_hit_tokens"], body["usage"]["prompt_cache_miss_tokens"]
            ) == (0, 2)
    params = engine.requests[0].params
    assert params.max_tokens == 3 and params.temperature == 0.0


def test_chat_default_max_tokens_runs_to_context(http, engine):
    r = chat(http)
    assert r.status_code == 200
    assert engine.requests[0].params.max_tokens == 64
    assert r.json()["usage"]["completion_tokens"] == 62


def test_content_parts_and_roles(http, engine):
    msgs = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a "},
                                     {"type": "text", "text": "b"}]},
    ]
    r = chat(http, messages=msgs, max_tokens=1, add_generation_prompt=False)
    assert r.status_code == 200, r.text
    req = engine.requests[0]
    assert [(m.role, m.content) for m in req.messages] == [("system", "be brief"), ("user", "a b")]
    assert req.add_generation_prompt is False


def test_chat_streaming_with_usage(http):
    r = chat(http, max_tokens=3, stream=True, stream_options={"include_usage": True})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = sse(r)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == " w0 w1 w2"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 3


def test_chat_n_and_seed(http, engine):
    r = chat(http, max_tokens=2, n=3, seed=7)
    assert r.status_code == 200
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [q.params.seed for q in engine.requests] == [7, 8, 9]
    assert len({q.request_id for q in engine.requests}) == 3
    assert body["usage"]["prompt_tokens"] == 2  # the prompt counts once
    assert body["usage"]["completion_tokens"] == 6


def test_chat_logprobs(http):
    r = chat(http, max_tokens=2, logprobs=True, top_logprobs=3)
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 2
    assert content[0]["token"] == " w0" and content[0]["logprob"] == -0.5
    assert content[0]["bytes"] == list(b" w0")
    assert [t["token"] for t in content[0]["top_logprobs"]] == [" alt0", " alt1", " alt2"]


def test_sampling_extensions_pass_through(http, engine):
    r = chat(http, max_tokens=2, top_k=5, min_p=0.1, repetition_penalty=1.2, ignore_eos=True,
             stop=["x", "y"], stop_token_ids=[3], skip_special_tokens=False, top_p=0.5,
             frequency_penalty=0.5, presence_penalty=-0.5, user="u", logit_bias={})
    assert r.status_code == 200, r.text
    p = engine.requests[0].params
    assert (p.top_k, p.min_p, p.repetition_penalty, p.ignore_eos) == (5, 0.1, 1.2, True)
    assert (p.stop, p.stop_token_ids, p.skip_special_tokens) == (["x", "y"], [3], False)
    assert (p.top_p, p.frequency_penalty, p.presence_penalty) == (0.5, 0.5, -0.5)


def test_completion_echo_logprobs_stop(http, engine):
    r = http.post("/v1/completions", json={
        "model": MODEL, "prompt": "one two", "max_tokens": 5, "echo": True, "logprobs": 2,
        "stop": "w2"})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert body["object"] == "text_completion"
    assert choice["text"] == "one two w0 w1" and choice["finish_reason"] == "stop"
    lp = choice["logprobs"]
    assert lp["tokens"][:2] == [" w0", " w1"]
    assert lp["text_offset"][:2] == [7, 10]
    assert all(len(t) == 3 for t in lp["top_logprobs"])  # 2 alternatives + the chosen token
    assert engine.requests[0].params.max_tokens == 5


def test_completion_defaults_and_batches(http, engine):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": ["a b", "c"], "n": 2})
    assert r.status_code == 200
    body = r.json()
    assert len(body["choices"]) == 4
    assert engine.requests[0].params.max_tokens == 16
    assert body["usage"]["prompt_tokens"] == 3
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [[5, 6, 7]],
                                           "max_tokens": 1})
    assert r.status_code == 200
    assert engine.requests[-1].prompt_token_ids is not None


def test_completion_streaming(http):
    r = http.post("/v1/completions", json={
        "model": MODEL, "prompt": "a b", "max_tokens": 2, "stream": True, "echo": True,
        "stream_options": {"include_usage": True}})
    chunks = sse(r)
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == "a b w0 w1"
    assert chunks[-1]["usage"]["total_tokens"] == 4


def test_lifespan_stops_engine(engine, state):
    with TestClient(build_app(state, lambda: engine)):
        assert engine.started
    assert engine.stopped
