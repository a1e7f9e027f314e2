"""The Anthropic Messages API as a translation: requests decoded and turned into the OpenAI chat
request the shared path runs (checked by that path's own validators), its errors renamed and
reshaped, whole turns and streamed deltas turned into Anthropic's message and events; and,
through the app with no engine, what fails before one is needed (decoding, auth)."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
from starlette.testclient import TestClient

from deepinfer.frontend.auth import authorized
from deepinfer.frontend.server.anthropic.messages import _events, error_body
from deepinfer.frontend.server.anthropic.request import chat_body, renamed
from deepinfer.frontend.server.anthropic.response import MessageEvents, message_body
from deepinfer.frontend.server.anthropic.schema import (
    TextOut,
    decode_count_tokens,
    decode_messages,
)
from deepinfer.frontend.server.app import build_app
from deepinfer.frontend.server.common import lenient
from deepinfer.frontend.server.common.chat_turns import Turn, TurnDelta, decode_chat_dict
from deepinfer.frontend.server.common.prompts import chat_messages
from deepinfer.frontend.server.common.sampling import chat_params
from deepinfer.frontend.server.common.thinking import template_kwargs
from deepinfer.frontend.server.common.usage import PromptTokensDetails, Usage
from deepinfer.frontend.server.errors import APIError, decode_error
from deepinfer.frontend.server.openapi import openapi_document
from deepinfer.frontend.server.parsers.tool_calls.call_log import ToolCall, ToolCallDelta
from deepinfer.frontend.server.parsers.tool_calls.tools import parse_tools
from deepinfer.frontend.server.state import ServerState

WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def _request(**fields):
    body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}]}
    return decode_messages(json.dumps({**body, **fields}).encode())


def _chat(context_len: int = 4096, **fields):
    return decode_chat_dict(chat_body(_request(**fields), context_len))


# ---------------------------------------------------------------- request


def test_a_conversation_with_tools_and_thinking_becomes_openai_messages():
    system = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}]
    req = _chat(system=system, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Weather in "},
                                     {"type": "text", "text": "Rome?",
                                      "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Use the tool.", "signature": "sig"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Rome"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "timeout"}]},
            {"type": "text", "text": "And tomorrow?"}]},
        {"role": "assistant", "content": "Let me see."},
    ])
    engine = chat_messages(req.messages)
    assert [(m.role, m.content) for m in engine] == [
        ("system", "Be brief.\n\nBe kind."), ("user", "Weather in Rome?"),
        ("assistant", "Checking."), ("tool", "Sunny"), ("tool", "Error: timeout"),
        ("user", "And tomorrow?"), ("assistant", "Let me see.")]
    assert engine[2].reasoning_content == "Use the tool."
    (call,) = engine[2].tool_calls
    assert call["id"] == "toolu_1" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Rome"}
    assert [m.tool_call_id for m in engine[3:5]] == ["toolu_1", "toolu_2"]


def test_sampling_fields_map_to_the_chat_request():
    req = _chat(stop_sequences=["END"], temperature=0.5, top_p=0.9, top_k=5,
                metadata={"user_id": "u"}, service_tier="auto", stream=True)
    params = chat_params(req, 4096)
    assert (params.stop, params.temperature, params.top_p, params.top_k, params.max_tokens) == \
        (["END"], 0.5, 0.9, 5, 64)
    assert req.n is None and req.stream is None  # one choice; streaming is the endpoint's


def test_max_tokens_past_the_context_means_to_its_end():
    assert _chat(context_len=2048, max_tokens=32000).max_tokens == 2048


@pytest.mark.parametrize(("thinking", "kwargs"), [
    ({"type": "enabled", "budget_tokens": 1024}, {"thinking": True, "enable_thinking": True}),
    ({"type": "disabled"}, {"thinking": False, "enable_thinking": False}),
    ({"type": "adaptive"}, None),
])
def test_thinking_becomes_the_templates_switches(thinking, kwargs):
    assert template_kwargs(_chat(thinking=thinking)) == kwargs


@pytest.mark.parametrize(("choice", "mode", "named", "parallel"), [
    (None, "auto", None, True),
    ({"type": "auto", "disable_parallel_tool_use": True}, "auto", None, False),
    ({"type": "any"}, "required", None, True),
    ({"type": "tool", "name": "get_weather"}, "named", "get_weather", True),
    ({"type": "none"}, "none", None, True),
])
def test_tools_and_tool_choice(choice, mode, named, parallel):
    fields = {"tools": [WEATHER]} | ({"tool_choice": choice} if choice else {})
    req = _chat(**fields)
    setup = parse_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    assert (setup.mode, setup.named, setup.parallel) == (mode, named, parallel)
    assert setup.functions == [{"name": "get_weather", "description": "Weather of a city",
                                "parameters": WEATHER["input_schema"]}]


def test_count_tokens_asks_for_one_token():
    req = decode_count_tokens(json.dumps({
        "model": "m", "system": "S", "tools": [WEATHER],
        "messages": [{"role": "user", "content": "Hi"}]}).encode())
    chat = decode_chat_dict(chat_body(req, 4096))
    assert chat.max_tokens == 1 and chat.messages[0].content == "S" and len(chat.tools) == 1


@pytest.mark.parametrize(("messages", "param"), [
    ([{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}],
     "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {}}]}]}], "messages[0].content[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                    "input": {}}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": "Hi"},
      {"role": "assistant", "content": [{"type": "document", "source": {}}]}],
     "messages[1].content[0].type"),
])
def test_content_a_text_model_cannot_take_is_refused_by_name(messages, param):
    with pytest.raises(APIError) as err:
        chat_body(_request(messages=messages), 4096)
    assert err.value.param == param and err.value.status == 400


@pytest.mark.parametrize(("fields", "name"), [
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]},
     "messages[0].content[0].type"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
])
def test_decoding_names_the_bad_field(fields, name):
    with pytest.raises(msgspec.ValidationError) as err:
        _request(**fields)
    exc = decode_error(err.value)
    assert exc.param == name
    assert name.split(".")[-1] in error_body(exc).error.message


def test_fields_claude_code_sends_are_accepted(caplog):
    """What Claude Code 2.1 and the anthropic SDK's types send (each was a 400): fields that
    change nothing are ignored, each logged once; a system message inside `messages` stays a
    system message there; the per-session billing line leaves the system prompt; server tools
    are dropped; a search_result block is text; output_config.format is structured output."""
    tool = {**WEATHER, "eager_input_streaming": True, "defer_loading": False,
            "input_examples": [{"city": "Rome"}], "allowed_callers": ["direct"]}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {
            "type": "search_result", "source": "https://x.org", "title": "X",
            "content": [{"type": "text", "text": "x says y"}]}]},
        {"role": "system", "content": "Agents: none"},
        {"role": "assistant", "content": [{
            "type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Rome"},
            "caller": {"type": "direct"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": "sunny"}]},
    ]
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.fa0;"},
              {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}}]
    fields = dict(
        messages=messages, system=system, tools=[tool, {"type": "web_search_20250305",
                                                        "name": "web_search", "max_uses": 5}],
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        output_config={"effort": "high"}, thinking={"type": "adaptive", "display": "omitted"},
        inference_geo="us", speed="fast", container="c1", mcp_servers=[])
    lenient._logged.clear()
    with caplog.at_level("WARNING", logger="deepinfer.api"):
        chat = _chat(**fields)
        _chat(**fields)
    assert [(m.role, m.content if isinstance(m.content, str) else [p.text for p in m.content])
            for m in chat.messages] == [
        ("system", "You are an agent."), ("user", ["Hi", "X\nhttps://x.org\n\nx says y"]),
        ("system", "Agents: none"), ("assistant", []), ("tool", "sunny")]
    assert [t["function"]["name"] for t in chat.tools] == ["get_weather"]
    assert chat.reasoning_effort == "high"
    ignored = [r.getMessage() for r in caplog.records if "ignoring the field" in r.getMessage()]
    for name in ("context_management", "tools[].eager_input_streaming", "thinking.display",
                 "messages[].content[].caller", "inference_geo", "mcp_servers"):
        assert sum(f"field {name}," in m for m in ignored) == 1, (name, ignored)
    counted = decode_count_tokens(json.dumps(
        {"model": "m", "messages": messages, "output_config": {"effort": "low"}}).encode())
    assert counted.output_config.effort == "low"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = _chat(output_config={"format": {"type": "json_schema", "schema": schema}})
    assert fmt.response_format == {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": schema}}


def test_a_custom_tool_without_input_schema_is_refused():
    with pytest.raises(APIError) as err:
        chat_body(_request(tools=[{"name": "f"}]), 4096)
    assert err.value.param == "tools[0].input_schema"


# ---------------------------------------------------------------- errors


def test_the_chat_paths_errors_speak_anthropic_names():
    with pytest.raises(APIError) as err:
        chat_params(_chat(stop_sequences=[""]), 4096)
    exc = renamed(err.value)
    assert exc.param == "stop_sequences"
    assert error_body(exc).error.message == "stop_sequences: stop strings must not be empty"

    with pytest.raises(APIError) as err:
        req = _chat(tools=[dict(WEATHER, name="bad name")])
        parse_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    exc = renamed(err.value)
    assert exc.param == "tools[0].name" and exc.message.startswith("tools[0].name must be")

    with pytest.raises(APIError) as err:
        req = _chat(tool_choice={"type": "any"})
        parse_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    assert renamed(err.value).message == "tool_choice 'any' needs tools"


@pytest.mark.parametrize(("status", "kind"), [
    (400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
    (413, "request_too_large"), (500, "api_error"), (503, "overloaded_error")])
def test_error_types_follow_the_status(status, kind):
    body = msgspec.to_builtins(error_body(APIError("x", status)))
    assert body["type"] == "error" and body["error"]["type"] == kind


# ---------------------------------------------------------------- responses


def _usage(prompt=20, completion=7, cached=16) -> Usage:
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(cached))


def test_a_turn_becomes_a_message():
    turn = Turn("Think.", "Checking.", [ToolCall("call_abc", "get_weather", '{"city":"Rome"}')],
                [], "tool_calls", None)
    body = msgspec.to_builtins(message_body("msg_1", "m", turn, _usage()))
    assert body == {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
        "content": [{"type": "thinking", "thinking": "Think.", "signature": ""},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_abc", "name": "get_weather",
                     "input": {"city": "Rome"}}],
        "stop_reason": "tool_use", "stop_sequence": None,
        "usage": {"input_tokens": 4, "output_tokens": 7, "cache_read_input_tokens": 16,
                  "cache_creation_input_tokens": 0}}


@pytest.mark.parametrize(("finish", "stop", "reason", "sequence"), [
    ("stop", None, "end_turn", None), ("stop", "END", "stop_sequence", "END"),
    ("length", None, "max_tokens", None), ("tool_calls", None, "tool_use", None),
    ("abort", None, "end_turn", None)])
def test_stop_reasons(finish, stop, reason, sequence):
    body = message_body("msg_1", "m", Turn("", "x", [], [], finish, stop), _usage())
    assert (body.stop_reason, body.stop_sequence) == (reason, sequence)
    assert body.content == [TextOut("x")]


def test_the_stream_opens_a_block_per_kind_and_per_call():
    deltas = [
        TurnDelta(0, reasoning="Hm"), TurnDelta(0, reasoning="m."),
        TurnDelta(0, content="Call"), TurnDelta(0, content="ing."),
        TurnDelta(0, calls=[ToolCallDelta(0, "call_a", "f", '{"x"')]),
        TurnDelta(0, calls=[ToolCallDelta(0, None, None, ': 1}'),
                            ToolCallDelta(1, "call_b", "g", "{}")]),
        TurnDelta(0, finish_reason="tool_calls"),
    ]
    events = MessageEvents()
    out = events.start("msg_1", "m", _usage(completion=0, cached=0))
    for d in deltas:
        out += events.feed(d)
    out += events.finish(_usage())
    names = [name for name, _ in out]
    assert names == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in out)
    start = out[0][1]["message"]
    assert start["content"] == [] and start["usage"]["input_tokens"] == 20
    blocks = [d["content_block"] for n, d in out if n == "content_block_start"]
    assert blocks == [{"type": "thinking", "thinking": "", "signature": ""},
                      {"type": "text", "text": ""},
                      {"type": "tool_use", "id": "toolu_a", "name": "f", "input": {}},
                      {"type": "tool_use", "id": "toolu_b", "name": "g", "input": {}}]
    deltas_by_block: dict[int, list] = {}
    for name, data in out:
        if name == "content_block_delta":
            deltas_by_block.setdefault(data["index"], []).append(data["delta"])
    assert deltas_by_block[0] == [{"type": "thinking_delta", "thinking": "Hm"},
                                  {"type": "thinking_delta", "thinking": "m."}]
    assert "".join(d["partial_json"] for d in deltas_by_block[2]) == '{"x": 1}'
    assert deltas_by_block[3] == [{"type": "input_json_delta", "partial_json": "{}"}]
    assert out[-2][1] == {"type": "message_delta",
                          "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                          "usage": {"input_tokens": 4, "output_tokens": 7,
                                    "cache_read_input_tokens": 16,
                                    "cache_creation_input_tokens": 0}}


def test_a_stream_stopped_by_a_sequence_says_which():
    events = MessageEvents()
    out = events.feed(TurnDelta(0, content="a", finish_reason="stop", stop_reason="END"))
    out += events.finish(_usage())
    assert [n for n, _ in out] == ["content_block_start", "content_block_delta",
                                   "content_block_stop", "message_delta", "message_stop"]
    assert out[3][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


class _FailingRun:
    """A run whose engine fails after one delta (what ChatRun.deltas raises then)."""

    state = ServerState(max_pending=1)
    model = "tiny"  # what the response names
    closed = False

    def usage(self) -> Usage:
        return _usage(completion=1, cached=0)

    async def deltas(self):
        yield TurnDelta(0, content="Hal")
        raise APIError("engine failed: worker died", 503, type="server_error")

    async def close(self) -> None:
        self.closed = True


def test_an_engine_failure_mid_stream_is_an_error_event():
    run = _FailingRun()

    async def frames() -> list[bytes]:
        return [f async for f in _events(run, "msg_1")]  # type: ignore[arg-type]

    text = b"".join(asyncio.run(frames())).decode()
    events = [(f.split("\n")[0], json.loads(f.split("\n")[1].removeprefix("data: ")))
              for f in text.strip().split("\n\n")]
    assert [name for name, _ in events] == [
        "event: message_start", "event: ping", "event: content_block_start",
        "event: content_block_delta", "event: error"]
    assert events[-1][1] == {"type": "error", "error": {
        "type": "overloaded_error", "message": "engine failed: worker died"}}
    assert run.closed


# ---------------------------------------------------------------- app, auth, openapi


def test_x_api_key_is_taken_on_the_messages_routes_only():
    assert authorized("k", "/v1/messages", None, "k")
    assert authorized("k", "/v1/messages/count_tokens", "Bearer k", "wrong")
    assert not authorized("k", "/v1/messages", None, "wrong")
    assert not authorized("k", "/v1/chat/completions", None, "k")


def _no_engine():
    raise AssertionError("no engine in these tests")


def test_the_app_answers_in_anthropics_shape():
    app = build_app(ServerState(max_pending=4, api_key="k"), _no_engine)
    client = TestClient(app)  # no lifespan: nothing here reaches an engine
    bad = client.post("/v1/messages", headers={"x-api-key": "k", "anthropic-version": "2023-06-01"},
                      json={"model": "m", "max_tokens": "5", "messages": []})
    assert bad.status_code == 400
    assert bad.json()["type"] == "error" and bad.json()["error"]["type"] == \
        "invalid_request_error" and "max_tokens" in bad.json()["error"]["message"]
    image = client.post("/v1/messages/count_tokens", headers={"Authorization": "Bearer k"},
                        json={"model": "m", "messages": [{"role": "user", "content": [
                            {"type": "image", "source": {}}]}]})
    assert image.status_code == 400 and "not supported" in image.json()["error"]["message"]
    denied = client.post("/v1/messages", headers={"x-api-key": "nope"}, json={})
    assert denied.status_code == 401
    assert denied.json()["error"]["type"] == "authentication_error"
    assert client.post("/v1/chat/completions", headers={"x-api-key": "k"},
                       json={}).json()["error"]["code"] == "invalid_api_key"
    wrong_method = client.get("/v1/messages", headers={"x-api-key": "k"})
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert wrong_method.json()["type"] == "error" and \
        wrong_method.json()["error"]["type"] == "invalid_request_error"


def test_openapi_describes_the_messages_routes():
    doc = openapi_document("0", api_key=True)
    create = doc["paths"]["/v1/messages"]["post"]
    assert create["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "AnthropicMessagesRequest")
    assert {"x-api-key": []} in create["security"]
    assert "/v1/messages/count_tokens" in doc["paths"]
    assert "AnthropicMessage" in doc["components"]["schemas"]
