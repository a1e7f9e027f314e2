"""The Responses API as a translation: input items -> chat messages and a chat request the chat
path accepts, a chat Turn -> output items and a response the real `openai` SDK parses, the
streamed events (each checked against the SDK's event types), and the bounded store."""

from __future__ import annotations

import json

import msgspec
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from deepinfer.frontend.server.common import lenient
from deepinfer.frontend.server.common.chat_turns import Turn, TurnDelta, decode_chat_dict
from deepinfer.frontend.server.common.usage import PromptTokensDetails, Usage
from deepinfer.frontend.server.errors import APIError
from deepinfer.frontend.server.parsers.tool_calls.call_log import ToolCall, ToolCallDelta
from deepinfer.frontend.server.responses.input import (
    chat_messages,
    chat_request,
    parse_items,
    responses_error,
    tool_namespaces,
)
from deepinfer.frontend.server.responses.output import base_response, finished, output_items
from deepinfer.frontend.server.responses.schema import ResponsesRequest, decode_responses
from deepinfer.frontend.server.responses.store import ResponseStore, StoredResponse
from deepinfer.frontend.server.responses.stream import _Events

USAGE = Usage(7, 5, 12, PromptTokensDetails(3))
TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
          "strict": True}]


def request(**body) -> ResponsesRequest:
    return decode_responses(json.dumps(body).encode())


def test_a_string_input_is_one_user_message():
    assert chat_messages(parse_items("hi")) == [{"role": "user", "content": "hi"}]


def test_a_conversation_of_items_becomes_chat_turns():
    items = parse_items([
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "input_text", "text": "weather "},
                                     {"type": "input_text", "text": "in Rome?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "use the tool"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Rome"}', "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather",
         "arguments": '{"city": "Milan"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "compare"}]},
        {"role": "assistant", "content": "Rome is sunnier."},
        {"role": "user", "content": "thanks"},
    ])
    assert chat_messages(items) == [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "weather in Rome?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "use the tool",
         "tool_calls": [
             {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
             {"id": "call_2", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Milan"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "assistant", "content": "Rome is sunnier.", "reasoning_content": "compare"},
        {"role": "user", "content": "thanks"},
    ]


def test_a_call_without_text_before_it_is_an_assistant_turn_of_its_own():
    items = parse_items([{"role": "user", "content": "go"},
                         {"type": "function_call", "call_id": "c", "name": "f",
                          "arguments": "{}"}])
    assert chat_messages(items)[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


@pytest.mark.parametrize(("items", "param"), [
    ([{"type": "item_reference", "id": "x"}], "input[0].type"),
    ([{"role": "user", "content": "a"}, {"type": "function_call", "name": "f"}],
     "input[1].call_id"),
    ([{"role": "tool", "content": "a"}], "input[0].role"),
    ([{"role": "user", "content": 5}], "input[0].content"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}],
     "input[0].content[0].type"),
])
def test_a_bad_item_is_a_400_naming_it(items, param):
    with pytest.raises(APIError) as err:
        chat_messages(parse_items(items))
    assert (err.value.status, err.value.param) == (400, param)


def test_the_chat_request_carries_every_setting_in_chat_shape():
    req = request(model="m", input="hi", instructions="be kind", max_output_tokens=9,
                  temperature=0.5, top_p=0.9, tools=TOOLS,
                  tool_choice={"type": "function", "name": "get_weather"},
                  parallel_tool_calls=False, reasoning={"effort": "low"}, stream=True,
                  text={"format": {"type": "json_schema", "name": "w", "strict": True,
                                   "schema": {"type": "object"}}},
                  store=True, metadata={"k": "v"}, user="u", truncation="disabled",
                  include=["reasoning.encrypted_content"])
    body = chat_request(req, parse_items(req.input))
    assert body == {
        "model": "m", "messages": [{"role": "system", "content": "be kind"},
                                   {"role": "user", "content": "hi"}],
        "max_completion_tokens": 9, "temperature": 0.5, "top_p": 0.9,
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "the weather",
            "parameters": TOOLS[0]["parameters"], "strict": True}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False, "reasoning_effort": "low", "stream": True, "user": "u",
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "w", "schema": {"type": "object"}, "strict": True}},
    }
    chat = decode_chat_dict(body)  # what the chat path will check, as a client's request
    assert chat.max_completion_tokens == 9 and chat.messages[0].role == "system"


@pytest.mark.parametrize(("fmt", "expected"), [
    ({"type": "text"}, None),
    ({"type": "json_object"}, {"type": "json_object"}),
])
def test_text_formats(fmt, expected):
    req = request(input="hi", text={"format": fmt})
    assert chat_request(req, parse_items(req.input)).get("response_format") == expected


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [TOOLS[0], {"name": "f"}]}, "tools[1]"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"truncation": "middle"}, "truncation"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(body, param):
    req = request(input="hi", **body)
    with pytest.raises(APIError) as err:
        chat_request(req, parse_items(req.input))
    assert err.value.param == param


def test_what_codex_sends_is_served(caplog):
    """Codex 0.171's request: client_metadata (and any unknown field) ignored and logged once; a
    namespace tool is its function tools; hosted tools (web_search) are dropped, logged once;
    a value of the wrong type is still a 400."""
    lenient._logged.clear()
    namespace = {"type": "namespace", "name": "agents", "description": "sub-agents", "tools": [
        {"type": "function", "name": "close_agent", "parameters": {"type": "object"},
         "strict": False, "future_field": 1}]}
    with caplog.at_level("WARNING", logger="deepinfer.api"):
        req = request(input="hi", tools=[TOOLS[0], namespace, {"type": "web_search",
                                                               "external_web_access": False}],
                      client_metadata={"thread_id": "t"}, include=["reasoning.encrypted_content"])
        chat = decode_chat_dict(chat_request(req, parse_items(req.input)))
        chat_request(req, parse_items(req.input))
    assert [t["function"]["name"] for t in chat.tools] == ["get_weather", "close_agent"]
    logged = [r.getMessage() for r in caplog.records]
    assert sum("client_metadata" in m for m in logged) == 1
    assert sum("'web_search'" in m for m in logged) == 1
    assert sum("future_field" in m for m in logged) == 1
    with pytest.raises(msgspec.ValidationError, match="Expected `int"):
        request(input="hi", max_output_tokens="ten")


@pytest.mark.parametrize(("chat_param", "param", "message"), [
    ("messages", "input", "input must not be empty"),
    ("max_completion_tokens", "max_output_tokens", "max_output_tokens must be at least 1"),
    ("tools[2].function.name", "tools[2].name", "tools[2].name is bad"),
    ("response_format.json_schema.schema", "text.format.schema", "text.format.schema is bad"),
    ("response_format.type", "text.format.type", "text.format.type is bad"),
    ("temperature", "temperature", "temperature is bad"),
])
def test_chat_field_names_in_errors_become_this_apis(chat_param, param, message):
    chat_message = message.replace(param, chat_param) if param != "input" else \
        "messages must not be empty"
    err = responses_error(APIError(chat_message, param=chat_param, code="c"))
    assert (err.param, err.message, err.code, err.status) == (param, message, "c", 400)


def turn(**kw) -> Turn:
    fields = dict(reasoning="", content="", calls=[], logprobs=[], finish_reason="stop",
                  stop_reason=None)
    return Turn(**(fields | kw))


def sdk_response(req: ResponsesRequest, t: Turn, reasoning_on: bool = True) -> Response:
    base = base_response(req, "resp_1", 100, "m", stored=True)
    body = finished(base, output_items(t, reasoning_on), t.finish_reason, USAGE, 101)
    return Response.model_validate(json.loads(msgspec.json.encode(body)))


def test_a_turn_becomes_reasoning_message_and_calls_the_sdk_reads():
    calls = [ToolCall("call_a", "get_weather", '{"city": "Rome"}')]
    r = sdk_response(request(input="hi", tools=TOOLS),
                     turn(reasoning="think", content="Checking.", calls=calls,
                          finish_reason="tool_calls"))
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    assert r.output[0].content[0].text == "think" and r.output[0].id.startswith("rs_")
    assert r.output_text == "Checking." and r.output[1].status == "completed"
    call = r.output[2]
    assert (call.call_id, call.name, call.arguments, call.status) == (
        "call_a", "get_weather", '{"city": "Rome"}', "completed")
    assert call.id.startswith("fc_")
    assert (r.status, r.incomplete_details, r.completed_at) == ("completed", None, 101)
    assert r.tools[0].name == "get_weather" and r.tool_choice == "auto"
    assert r.usage.input_tokens == 7 and r.usage.output_tokens == 5
    assert r.usage.total_tokens == 12 and r.usage.input_tokens_details.cached_tokens == 3


def test_without_a_reasoning_parser_or_text_only_calls_are_output():
    r = sdk_response(request(input="hi"), turn(reasoning="x", calls=[ToolCall("c", "f", "{}")]),
                     reasoning_on=False)
    assert [o.type for o in r.output] == ["function_call"] and r.output_text == ""


def test_a_turn_cut_by_max_output_tokens_is_incomplete():
    r = sdk_response(request(input="hi", max_output_tokens=2),
                     turn(content="Half", finish_reason="length"))
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.max_output_tokens == 2


def test_the_request_is_echoed():
    r = sdk_response(request(input="hi", instructions="be kind", temperature=0.2,
                             text={"format": {"type": "json_object"}}, metadata={"k": "v"},
                             previous_response_id="resp_0", reasoning={"effort": "low"}),
                     turn(content="{}"))
    assert (r.instructions, r.temperature, r.top_p, r.text.format.type, r.metadata) == (
        "be kind", 0.2, 1.0, "json_object", {"k": "v"})
    assert (r.previous_response_id, r.reasoning.effort, r.store) == ("resp_0", "low", True)


def test_output_items_parse_back_as_input_items():
    t = turn(reasoning="think", content="Checking.", calls=[ToolCall("call_a", "f", "{}")])
    items = parse_items(msgspec.to_builtins(output_items(t, True)))
    assert chat_messages(items) == [{"role": "assistant", "content": "Checking.",
                                     "reasoning_content": "think", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]


def _events(deltas: list[TurnDelta]) -> list[dict]:
    events = _Events(base_response(request(input="hi"), "resp_1", 100, "m", stored=False))
    frames = [events.response("response.created", events.base)]
    for d in deltas:
        frames += events.delta(d)
    finish = next(d.finish_reason for d in reversed(deltas) if d.finish_reason)
    frames += events.finish(finish, USAGE)[0]
    out = []
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    for frame in frames:
        kind, data = frame.decode().removesuffix("\n\n").split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        adapter.validate_python(event)  # the SDK's own event types, strictly
        out.append(event)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def test_streamed_events_open_and_close_each_item_in_order():
    events = _events([
        TurnDelta(0, reasoning="thi"), TurnDelta(0, reasoning="nk"),
        TurnDelta(0, content="Check"), TurnDelta(0, content="ing."),
        TurnDelta(0, calls=[ToolCallDelta(0, "call_a", "f", '{"a"')]),
        TurnDelta(0, calls=[ToolCallDelta(0, None, None, ": 1}")]),
        TurnDelta(0, finish_reason="tool_calls"),
    ])
    assert [e["type"].removeprefix("response.") for e in events] == [
        "created",
        "output_item.added", "content_part.added", "reasoning_text.delta",
        "reasoning_text.delta", "reasoning_text.done", "content_part.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.delta",
        "output_text.done", "content_part.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.delta",
        "function_call_arguments.done", "output_item.done",
        "completed"]
    final = Response.model_validate(events[-1]["response"])
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Checking." and final.output[2].arguments == '{"a": 1}'
    assert {e["output_index"] for e in events if e["type"].endswith("arguments.delta")} == {2}


def test_a_stream_cut_by_max_output_tokens_ends_incomplete():
    events = _events([TurnDelta(0, content="Hal"), TurnDelta(0, content="f",
                                                             finish_reason="length")])
    assert events[-1]["type"] == "response.incomplete"
    assert events[-2]["item"]["status"] == "incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_stream_with_nothing_said_still_has_a_message():
    events = _events([TurnDelta(0, finish_reason="stop")])
    assert Response.model_validate(events[-1]["response"]).output[0].type == "message"


def stored(rid: str) -> StoredResponse:
    req = request(input="hi")
    return StoredResponse(base_response(req, rid, 0, "m", stored=True), parse_items("hi"))


def test_the_store_keeps_the_most_recently_used():
    store = ResponseStore(2)
    for rid in ("a", "b"):
        store.put(stored(rid))
    assert store.get("a") is not None  # "a" is now the more recent
    store.put(stored("c"))
    assert (store.get("b"), len(store)) == (None, 2)
    assert store.get("a").response.id == "a" and store.get("c") is not None


def test_delete_and_a_store_of_size_zero():
    store = ResponseStore(3)
    store.put(stored("a"))
    assert store.delete("a") and not store.delete("a") and store.get("a") is None
    off = ResponseStore(0)
    off.put(stored("a"))
    assert not off.enabled and len(off) == 0


def test_the_store_is_bounded_by_bytes_each_entry_with_its_conversation():
    """--responses-store-mb: a chain of responses is bounded by what its conversations hold, not
    by their number (one entry keeps its whole chain); one conversation past the bound is not
    kept at all."""
    size = stored("a").nbytes()
    store = ResponseStore(100, max_bytes=2 * size)
    for rid in ("a", "b", "c"):
        store.put(stored(rid))
    assert [store.get(rid) is not None for rid in "abc"] == [False, True, True]
    assert store.nbytes == 2 * size
    big = StoredResponse(stored("d").response, parse_items("hi " * size))
    store.put(big)
    assert store.get("d") is None and len(store) == 2
    assert store.delete("b") and store.nbytes == size


def test_a_call_to_a_namespace_tool_names_its_namespace():
    """Codex routes a call by name and namespace: a call to a function of a namespace tool says
    which, whole and streamed; a top-level function's call has no namespace field."""
    tools = [TOOLS[0], {"type": "namespace", "name": "agents", "description": "sub-agents",
                        "tools": [{"type": "function", "name": "close_agent",
                                   "parameters": {"type": "object"}}]}]
    namespaces = tool_namespaces(tools)
    assert namespaces == {"close_agent": "agents"}
    calls = [ToolCall("c1", "close_agent", "{}"), ToolCall("c2", "get_weather", "{}")]
    items = msgspec.to_builtins(output_items(turn(calls=calls, finish_reason="tool_calls"),
                                             False, namespaces=namespaces))
    assert [(i["name"], i.get("namespace")) for i in items] == [
        ("close_agent", "agents"), ("get_weather", None)]
    assert "namespace" not in items[1]
    events = _Events(base_response(request(input="hi", tools=tools), "r", 1, "m", stored=False),
                     namespaces=namespaces)
    frames = events.delta(TurnDelta(0, calls=[ToolCallDelta(0, "c1", "close_agent", "{}")]))
    frames += events.finish("tool_calls", USAGE)[0]
    added = json.loads(frames[0].decode().split("data: ")[1])
    assert added["item"]["namespace"] == "agents"
    assert parse_items(items)[0].namespace == "agents"  # sent back, it decodes
