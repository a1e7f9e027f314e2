"""The tokenizer's part in structured output and tool calling: a structured request's first
output waits for its grammar (a refusal must be the first thing the client sees), and tools
reach the prompt through the template or, when it knows no tools, Hermes-style."""

from __future__ import annotations

import copy
import json

import pytest

from deepinfer.engine.protocol import (
    ChatMessage,
    FinishReason,
    GenerateRequest,
    GrammarSpec,
    SamplingParams,
    TokenDelta,
    pack_ids,
)
from deepinfer.engine.tokenizer.tokenizer import Tokenizer
from deepinfer.engine.tokenizer.tokenizer_process import TokenizerService

REGEX = SamplingParams(grammar=GrammarSpec("regex", "a+"))
TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "Time now.",
                                           "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tok(default_model):
    return Tokenizer(str(default_model))


def test_first_output_is_held_until_the_grammar_is_ready(tok):
    service = TokenizerService(tok, 1024)
    tokenized, first = service.tokenize(GenerateRequest("r", REGEX, prompt="Say a"))
    assert tokenized is not None and first is None
    outs, _ = service.outputs(TokenDelta("r", b""))  # the scheduler's go-ahead
    assert [o.prompt_tokens for o in outs] == [len(tok.encode("Say a"))]
    ids = tok.encode("aaa", add_special_tokens=False) + [2]  # the EOS that stopped it
    outs, _ = service.outputs(TokenDelta("r", pack_ids(ids), finish_reason=FinishReason.STOP))
    assert [o.text for o in outs] == ["aaa"]


def test_a_refused_grammar_is_the_first_output(tok):
    service = TokenizerService(tok, 1024)
    service.tokenize(GenerateRequest("r", REGEX, prompt="Say a"))
    outs, _ = service.outputs(TokenDelta("r", b"", finish_reason=FinishReason.ERROR,
                                         error="invalid regex: nope"))
    assert len(outs) == 1 and outs[0].error == "invalid regex: nope"
    assert not service.live and not service.held


def test_plain_requests_answer_at_once(tok):
    service = TokenizerService(tok, 1024)
    _, first = service.tokenize(GenerateRequest("r", SamplingParams(), prompt="hi"))
    assert first is not None and first.prompt_text == "hi"


def test_abort_drops_a_held_output(tok):
    service = TokenizerService(tok, 1024)
    service.tokenize(GenerateRequest("r", REGEX, prompt="Say a"))
    service.abort(["r"])
    assert not service.held and service.outputs(TokenDelta("r", b""))[0] == []


def test_hermes_fallback_for_a_template_without_tools(tok):
    assert "tools" not in tok.chat_template  # SmolLM2's template knows no tools
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    text = tok.apply_chat_template([
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "12:00", "tool_call_id": "c1"},
    ], tools=TOOLS)
    system = text.split("<|im_end|>")[0]
    assert "<tools>" in system and json.dumps(TOOLS[0]) in system
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n12:00\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_that_renders_tools_gets_them(tok):
    tok = copy.copy(tok)
    tok.chat_template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                         "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}")
    tok._compiled = None
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=TOOLS) == (
        "[get_time]user:hi;")


def test_tool_fields_travel_in_chat_messages():
    from deepinfer.engine.tokenizer.tokenizer import chat_dict

    msg = ChatMessage("tool", "12:00", tool_call_id="c1")
    assert chat_dict(msg) == {"role": "tool", "content": "12:00", "tool_call_id": "c1"}
