"""Reasoning parsers (frontend/server/parsers/reasoning/) against recorded outputs of each family,
whole and streamed one character at a time, and `--reasoning-parser` through the chat endpoint
(fake engine with a scripted output): reasoning_content apart, content without the tags,
thinking switches handed to the template, bad switches refused by name."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from deepinfer.frontend.server.app import build_app
from deepinfer.frontend.server.parsers.reasoning.base import ReasoningDelta
from deepinfer.frontend.server.parsers.reasoning.registry import REASONING_PARSERS
from deepinfer.frontend.server.state import ServerState
from tests.frontend.server.fake_engine import chat, sse

# (parser, thinking, output as the model wrote it, reasoning, content)
RECORDED = [
    # DeepSeek-R1: its template ends the prompt with "<think>\n".
    ("deepseek_r1", None, "Okay, 2 + 2 is 4.\n</think>\n\nThe answer is **4**.",
     "Okay, 2 + 2 is 4.\n", "The answer is **4**."),
    # Older R1 checkpoints repeat the tag.
    ("deepseek_r1", None, "<think>\nShort.\n</think>\n\nYes.", "\nShort.\n", "Yes."),
    # Cut off by max_tokens inside the reasoning: all of it is reasoning.
    ("deepseek_r1", None, "Let me count: 1, 2, 3 </thi", "Let me count: 1, 2, 3 </thi", ""),
    # Thinking off for the request: the answer (the grammar constrains it from the start).
    ("deepseek_r1", False, '{"answer": 5}', "", '{"answer": 5}'),
    # Qwen3 opens the tag itself; thinking off, it writes no tag at all.
    ("qwen3", None, "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?",
     "\nThe user greets me.\n", "Hello! How can I help?"),
    ("qwen3", False, "Hello! How can I help?", "", "Hello! How can I help?"),
    ("qwen3", None, "x < y and <b>bold</b>", "", "x < y and <b>bold</b>"),
    # DeepSeek-V3.1 / V4: thinking on opens the tag in the prompt, off closes it there.
    ("deepseek_v3", True, "Check units.</think>It is 5 km.", "Check units.", "It is 5 km."),
    ("deepseek_v3", None, "It is 5 km.", "", "It is 5 km."),
]


@pytest.mark.parametrize(("name", "thinking", "output", "reasoning", "content"), RECORDED)
def test_recorded_outputs_split_alike_whole_and_char_by_char(name, thinking, output,
                                                              reasoning, content):
    whole = REASONING_PARSERS[name](thinking)
    got = whole.feed(output).merge(whole.finish())
    assert (got.reasoning, got.content) == (reasoning, content)
    streamed, parser = ReasoningDelta(), REASONING_PARSERS[name](thinking)
    for ch in output:
        streamed = streamed.merge(parser.feed(ch))
    assert streamed.merge(parser.finish()) == got


@pytest.fixture()
def reasoning_http(engine):
    state = ServerState(max_pending=8, reasoning_parser="deepseek_r1")
    with TestClient(build_app(state, lambda: engine)) as client:
        yield client


SCRIPT = ["Two", " plus two", ".\n</", "think", ">\n", "\n", "Four", "."]


def test_chat_returns_reasoning_apart_from_content(reasoning_http, engine):
    engine.script = SCRIPT
    r = chat(reasoning_http, max_tokens=20)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["content"] == "Four."
    assert message["reasoning_content"] == message["reasoning"] == "Two plus two.\n"


def test_streamed_chat_sends_reasoning_deltas_then_content(reasoning_http, engine):
    engine.script = SCRIPT
    chunks = sse(chat(reasoning_http, max_tokens=20, stream=True))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert (reasoning, content) == ("Two plus two.\n", "Four.")
    assert all("think>" not in (d.get("content") or "") for d in deltas)


def test_a_tool_call_after_the_reasoning_is_parsed_from_the_answer(reasoning_http, engine):
    engine.script = ["Use the tool.</think>", '<tool_call>{"name": "get_time", ',
                     '"arguments": {}}</tool_call>']
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    r = chat(reasoning_http, max_tokens=20, tools=tools)
    message = r.json()["choices"][0]
    assert message["message"]["reasoning_content"] == "Use the tool."
    assert message["message"]["tool_calls"][0]["function"]["name"] == "get_time"
    assert message["message"]["content"] is None


def test_without_a_parser_the_output_is_content_as_written(http, engine):
    engine.script = SCRIPT
    message = chat(http, max_tokens=20).json()["choices"][0]["message"]
    assert message["content"] == "".join(SCRIPT)
    assert "reasoning_content" not in message


@pytest.mark.parametrize(("body", "kwargs"), [
    ({"chat_template_kwargs": {"enable_thinking": False}}, {"enable_thinking": False}),
    ({"thinking": {"type": "enabled"}}, {"thinking": True, "enable_thinking": True}),
    ({"reasoning_effort": "high"}, {"reasoning_effort": "high"}),
    ({}, None),
])
def test_thinking_switches_reach_the_template(http, engine, body, kwargs):
    assert chat(http, max_tokens=2, **body).status_code == 200
    assert engine.requests[-1].template_kwargs == kwargs


@pytest.mark.parametrize(("body", "param"), [
    ({"thinking": {"type": "maybe"}}, "thinking.type"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
])
def test_bad_thinking_switches_are_a_400_naming_the_field(http, body, param):
    r = chat(http, max_tokens=2, **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_sent_back_reasoning_reaches_the_engine(http, engine):
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "add them"},
                {"role": "user", "content": "and 3+3?"}]
    assert chat(http, max_tokens=2, messages=messages).status_code == 200
    assert engine.requests[-1].messages[1].reasoning_content == "add them"


def test_deepseek_r1_with_thinking_off_answers_in_content(reasoning_http, engine):
    """The grammar honoured the switch (it constrained from the first token) while the parser
    put everything in reasoning_content: structured output came back with content empty, and a
    forced tool call empty."""
    engine.script = ['{"answer": ', "5}"]
    off = {"chat_template_kwargs": {"thinking": False}}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    message = chat(reasoning_http, max_tokens=5, response_format=fmt, **off).json()[
        "choices"][0]["message"]
    assert (message["content"], message["reasoning_content"]) == ('{"answer": 5}', None)
    assert engine.requests[-1].params.grammar.after == ""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    forced = {"type": "function", "function": {"name": "f"}}
    for stream in (False, True):
        r = chat(reasoning_http, max_tokens=5, tools=tools, tool_choice=forced, stream=stream,
                 **off)
        if stream:
            calls = [t for c in sse(r) if c["choices"]
                     for t in c["choices"][0]["delta"].get("tool_calls") or []]
        else:
            calls = r.json()["choices"][0]["message"]["tool_calls"]
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
            [("f", '{"answer": 5}')]


@pytest.mark.parametrize(("parser", "opened_by"), [("qwen3", "<think>"), ("deepseek_r1", "")])
def test_a_model_that_opens_its_reasoning_may_skip_it(engine, parser, opened_by):
    """Qwen3 writes `<think>` itself or answers at once: the grammar is told so (it waited for a
    `</think>` that never came, and the answer went unconstrained); R1's prompt opened it."""
    state = ServerState(max_pending=8, reasoning_parser=parser)
    with TestClient(build_app(state, lambda: engine)) as http:
        chat(http, max_tokens=2, response_format={"type": "json_object"})
    grammar = engine.requests[-1].params.grammar
    assert (grammar.after, grammar.opened_by) == ("</think>", opened_by)
