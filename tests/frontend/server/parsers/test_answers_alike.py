"""Whole and streamed answers agree item for item, through the real `openai` and `anthropic` SDKs
against the app (an in-process fake engine writes a fixed script, chunk by chunk): chat
completions, Anthropic messages and Responses, when one output chunk both ends a call and
carries text after it (as qwen3_xml, a stop sequence or n-gram speculation make it), and when a
call that started turns out malformed."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from starlette.testclient import TestClient

from deepinfer.frontend.server.app import build_app
from deepinfer.frontend.server.state import ServerState
from tests.frontend.server.fake_engine import MODEL, FakeEngineClient

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "input_schema": WEATHER}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
ASK = [{"role": "user", "content": "weather in Rome"}]
END = "END"  # the script's last piece, a stop string: the turn ends by itself

# The second piece ends the call and goes on with text, in one output chunk.
CALL_THEN_TEXT = ["Checking.", '<tool_call>{"name": "get_weather", "arguments": {"city": ',
                  '"Rome"}}</tool_call> Done.', END]
# A call that starts like one and never parses: text, with the tags.
MALFORMED = ["Checking.", '<tool_call>{"name": "get_weather", "arguments": {"city": ',
             '"Rome"</tool_call>', END]
MALFORMED_TEXT = "".join(MALFORMED[:-1])


@pytest.fixture
def app():
    engine = FakeEngineClient(MODEL)
    with TestClient(build_app(ServerState(max_pending=8), lambda: engine)) as http:
        yield engine, http


def _openai(http) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http,
                         max_retries=0)


def _chat(http, stream: bool) -> tuple[str, list[tuple[str, dict]], str]:
    """(content, calls as (name, arguments), finish_reason), as the SDK reads them."""
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=20, stop=[END])
    if not stream:
        choice = _openai(http).chat.completions.create(**kw).choices[0]
        calls = [(c.function.name, json.loads(c.function.arguments))
                 for c in choice.message.tool_calls or []]
        return choice.message.content or "", calls, choice.finish_reason
    content, names, args, finish = "", {}, {}, None
    for chunk in _openai(http).chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for c in choice.delta.tool_calls or []:
                names[c.index] = names.get(c.index) or c.function.name
                args[c.index] = args.get(c.index, "") + (c.function.arguments or "")
            finish = choice.finish_reason or finish
    # what the openai SDK's users do with the joined arguments
    return content, [(names[i], json.loads(args[i])) for i in sorted(names)], finish


def _blocks(message) -> list[tuple]:
    return [(b.type, b.text) if b.type == "text" else (b.type, b.name, b.input)
            for b in message.content]


def _messages(http, stream: bool) -> tuple[list[tuple], str]:
    client = anthropic.Anthropic(base_url="http://testserver", api_key="none",
                                 http_client=http, max_retries=0)
    kw = dict(model=MODEL, max_tokens=20, messages=ASK, tools=ANTHROPIC_TOOLS,
              stop_sequences=[END])
    if not stream:
        message = client.messages.create(**kw)
    else:
        with client.messages.stream(**kw) as s:
            message = s.get_final_message()
    return _blocks(message), message.stop_reason


def _items(response) -> list[tuple]:
    return [(i.type, i.content[0].text) if i.type == "message" else
            (i.type, i.name, json.loads(i.arguments)) for i in response.output]


def _responses(engine, http, stream: bool) -> list[tuple]:
    """(Responses take no stop strings: the script without its end, cut by its length.)"""
    if engine.script[-1] == END:
        engine.script = engine.script[:-1]
    kw = dict(model=MODEL, input="weather in Rome", tools=RESPONSES_TOOLS, max_output_tokens=20)
    if not stream:
        return _items(_openai(http).responses.create(**kw))
    events = list(_openai(http).responses.create(**kw, stream=True))
    return _items(events[-1].response)  # response.incomplete: cut by its length


def test_text_after_a_call_in_the_same_chunk(app):
    """The call keeps its closing fragment and its place before the text, whole and streamed
    (streamed, Anthropic sent the last input_json_delta on the text block's index and Responses
    dropped it: the joined arguments were `{"city": ` + nothing; whole, all text came first)."""
    engine, http = app
    for stream in (False, True):
        engine.script = CALL_THEN_TEXT
        assert _chat(http, stream) == ("Checking. Done.", [("get_weather", {"city": "Rome"})],
                                       "tool_calls")
        assert _messages(http, stream) == ([("text", "Checking."),
                                            ("tool_use", "get_weather", {"city": "Rome"}),
                                            ("text", " Done.")], "tool_use")
        assert _responses(engine, http, stream) == [("message", "Checking."),
                                            ("function_call", "get_weather", {"city": "Rome"}),
                                            ("message", " Done.")]


def test_a_malformed_call_is_text_whole_and_streamed(app):
    """It used to go out streamed as a call: chat's arguments `{"city": "Rome"` with
    finish_reason tool_calls, Anthropic's input {}."""
    engine, http = app
    for stream in (False, True):
        engine.script = MALFORMED
        assert _chat(http, stream) == (MALFORMED_TEXT, [], "stop")
        assert _messages(http, stream) == ([("text", MALFORMED_TEXT)], "end_turn")
        assert _responses(engine, http, stream) == [("message", MALFORMED_TEXT)]
