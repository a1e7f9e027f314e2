"""Fields no request struct declares: ignored wherever they sit, logged once each, within
bounds a client cannot push (retries per request, names remembered, what a log line shows)."""

from __future__ import annotations

import json

import msgspec
import pytest

from deepinfer.frontend.server.common import lenient
from deepinfer.frontend.server.common.openai_schema import ChatCompletionRequest, decode_chat


@pytest.fixture(autouse=True)
def fresh_log():
    lenient._logged.clear()
    yield
    lenient._logged.clear()


def _body(**fields) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def _ignored(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "deepinfer.api"]


def test_unknown_fields_anywhere_are_dropped_and_logged_once(caplog):
    messages = [{"role": "user", "content": "a", "x": 1}, {"role": "user", "content": "b"},
                {"role": "user", "content": "c", "x": {"deep": True}}]
    body = _body(messages=messages, stream_options={"include_usage": True, "y": 2}, z=None)
    with caplog.at_level("WARNING", logger="deepinfer.api"):
        for _ in range(3):
            req = decode_chat(body)
    assert [m.content for m in req.messages] == ["a", "b", "c"]
    assert req.stream_options.include_usage is True
    assert sorted(m.split("field ")[1].split(",")[0] for m in _ignored(caplog)) == [
        "messages[].x", "stream_options.y", "z"]


def test_a_wrong_type_is_still_an_error():
    with pytest.raises(msgspec.ValidationError, match=r"\$\.max_tokens"):
        decode_chat(_body(max_tokens="ten", extra=1))


def test_retries_are_bounded():
    body = _body(**{f"f{i}": i for i in range(lenient.MAX_DROPS + 1)})
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        decode_chat(body)
    assert len(decode_chat(_body(**{f"f{i}": i for i in range(lenient.MAX_DROPS)})
                           ).messages) == 1


def test_names_a_client_invents_neither_grow_memory_nor_flood_the_log(caplog, monkeypatch):
    monkeypatch.setattr(lenient, "MAX_LOGGED", 5)
    with caplog.at_level("WARNING", logger="deepinfer.api"):
        for i in range(20):
            lenient.convert_lenient({"messages": [], f"n{i}": 1}, ChatCompletionRequest, "/x")
        lenient.convert_lenient({"messages": [], "bad\nname" + "y" * 200: 1},
                                ChatCompletionRequest, "/y")
    logged = _ignored(caplog)
    assert len(lenient._logged) == 6 and len(logged) == 6
    assert "not logged" in logged[-1]
    lenient._logged.clear()
    with caplog.at_level("WARNING", logger="deepinfer.api"):
        lenient.convert_lenient({"messages": [], "bad\nname" + "y" * 200: 1},
                                ChatCompletionRequest, "/y")
    line = _ignored(caplog)[-1]
    assert "\n" not in line and "bad\\nname" in line and len(line) < 200
