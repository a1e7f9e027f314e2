"""vLLM's cache_salt request field on every generating API (chat, completions, Anthropic
messages, Responses): it reaches the engine as given, and a value that is no non-empty string is
a 400 naming the field, in each API's own error shape."""

from __future__ import annotations

import pytest

from tests.frontend.server.fake_engine import MODEL

BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
}


@pytest.mark.parametrize("path", sorted(BODIES))
def test_the_salt_reaches_the_engine(http, engine, path):
    r = http.post(path, json={"model": MODEL, "cache_salt": "tenant-a", **BODIES[path]})
    assert r.status_code == 200, r.text
    assert engine.requests[0].params.cache_salt == "tenant-a"


@pytest.mark.parametrize("path", sorted(BODIES))
def test_without_a_salt_none_is_sent(http, engine, path):
    r = http.post(path, json={"model": MODEL, **BODIES[path]})
    assert r.status_code == 200, r.text
    assert engine.requests[0].params.cache_salt is None


@pytest.mark.parametrize("path", sorted(BODIES))
@pytest.mark.parametrize("salt", ["", 7, ["a"], "x" * 1025])
def test_a_bad_salt_is_a_400_naming_the_field(http, engine, path, salt):
    r = http.post(path, json={"model": MODEL, "cache_salt": salt, **BODIES[path]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    where = error.get("param") or error.get("message")
    assert "cache_salt" in where, r.text
    assert not engine.requests
