"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) on a real server,
through the real `anthropic` SDK, on checkpoints whose greedy reply is a fixed script
(scripts/scripted_model.py): a plain answer on a server with --api-key (text whole and streamed,
stop sequences, max_tokens, usage, token counts, errors, x-api-key), and a reply that thinks,
writes and calls a tool on a server with --reasoning-parser qwen3 (thinking and tool_use blocks,
whole and streamed, a tool_result sent back)."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import pytest

from scripts.scripted_model import save_scripted_model
from scripts.server_process import ServerProcess

KEY = "s3cret"
ANSWER = "The answer is five"
ASK = [{"role": "user", "content": "What is two plus three?"}]

THOUGHT, SAYS = "Weather needs the tool", "Checking."
CALL_HEAD, CALL_ARGS = '{"name": "get_weather", "arguments": ', '{"city": "Rome"}}'
TOOL_SCRIPT = (f"<think>{THOUGHT}</think>{SAYS}<tool_call>{CALL_HEAD}{CALL_ARGS}</tool_call>")
WEATHER = {"name": "get_weather", "description": "The weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
WEATHER_ASK = [{"role": "user", "content": "Weather in Rome?"}]
THINK = {"type": "enabled", "budget_tokens": 1024}
# This SDK's methods have no temperature argument any more; the API still takes it, and the
# scripted models write their script only greedily.
GREEDY = {"extra_body": {"temperature": 0}}


def _client(srv: ServerProcess, **kw) -> anthropic.Anthropic:
    kw.setdefault("api_key", "none")
    return anthropic.Anthropic(base_url=srv.base_url, max_retries=0, timeout=60, **kw)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    model = save_scripted_model(tmp_path_factory.mktemp("scripted") / "model", ANSWER)
    srv = ServerProcess(model, "--num-kv-blocks", "64", "--served-model-name", "s",
                        "--api-key", KEY)
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def client(plain):
    return _client(plain, api_key=KEY)  # the SDK sends it as x-api-key


@pytest.fixture(scope="module")
def tooling(tmp_path_factory):
    model = save_scripted_model(
        tmp_path_factory.mktemp("scripted") / "model", TOOL_SCRIPT,
        ("<think>", "</think>", "<tool_call>", "</tool_call>", CALL_HEAD, CALL_ARGS))
    srv = ServerProcess(model, "--num-kv-blocks", "64", "--served-model-name", "s",
                        "--reasoning-parser", "qwen3")
    yield _client(srv)
    assert srv.stop() == 0, srv.output()


# ---------------------------------------------------------------- plain text


def test_a_plain_reply(client):
    r = client.messages.create(model="s", max_tokens=20, messages=ASK, **GREEDY)
    assert r.id.startswith("msg_") and (r.type, r.role, r.model) == ("message", "assistant", "s")
    assert [(b.type, b.text) for b in r.content] == [("text", ANSWER)]
    assert (r.stop_reason, r.stop_sequence) == ("end_turn", None)
    u = r.usage
    assert u.output_tokens >= 4 and u.input_tokens + u.cache_read_input_tokens > 10
    assert u.cache_creation_input_tokens == 0


def test_a_plain_reply_streamed(client):
    events = list(client.messages.create(model="s", max_tokens=20, messages=ASK,
                                         stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.content == [] and events[0].message.stop_reason is None
    assert "".join(e.delta.text for e in events[2:-3]) == ANSWER
    assert (events[-2].delta.stop_reason, events[-2].usage.output_tokens >= 4) == \
        ("end_turn", True)
    with client.messages.stream(model="s", max_tokens=20, messages=ASK, **GREEDY) as s:
        final = s.get_final_message()
    assert [b.text for b in final.content] == [ANSWER] and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == events[-2].usage.output_tokens


def test_every_sse_message_names_its_event(plain):
    body = {"model": "s", "max_tokens": 20, "messages": ASK, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{plain.base_url}/v1/messages", json=body, timeout=60,
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}) as r:
        assert r.status_code == 200
        text = "".join(r.iter_text())
    frames = [f.split("\n") for f in text.strip().split("\n\n")]
    names = [lines[0].removeprefix("event: ") for lines in frames]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"
    for name, lines in zip(names, frames):
        assert lines[0].startswith("event: ") and lines[1].startswith("data: ")
        assert json.loads(lines[1].removeprefix("data: "))["type"] == name


def test_a_stop_sequence_ends_the_reply(client):
    r = client.messages.create(model="s", max_tokens=20, messages=ASK,
                               stop_sequences=["five", "never"], **GREEDY)
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", "five")
    assert r.content[0].text == "The answer is "
    with client.messages.stream(model="s", max_tokens=20, messages=ASK,
                                stop_sequences=["five"], **GREEDY) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "five")


def test_max_tokens_ends_the_reply(client):
    r = client.messages.create(model="s", max_tokens=2, messages=ASK, **GREEDY)
    assert (r.stop_reason, r.stop_sequence, r.usage.output_tokens) == ("max_tokens", None, 2)
    assert r.content[0].text == "The answer"


def test_count_tokens_is_the_input_of_the_same_request(client):
    system = "Counting system prompt, in no other test"  # its first block is cached nowhere
    messages = [{"role": "user", "content": "Count these tokens, please."}]
    r = client.messages.create(model="s", max_tokens=3, system=system, messages=messages)
    assert r.usage.cache_read_input_tokens == 0
    count = client.messages.count_tokens(model="s", system=system, messages=messages)
    assert count.input_tokens == r.usage.input_tokens
    with_tools = client.messages.count_tokens(model="s", system=system, messages=messages,
                                              tools=[WEATHER])
    assert with_tools.input_tokens > count.input_tokens


def test_a_bad_field_is_an_invalid_request_error(client):
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="s", max_tokens=5, messages=ASK,
                               extra_body={"top_k": "five"})
    body = err.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "top_k" in body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="s", max_tokens=5, messages=ASK, stop_sequences=[""])
    assert err.value.body["error"]["message"].startswith("stop_sequences")
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="s", max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}])
    assert "not supported" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="claude-x", max_tokens=5, messages=ASK)
    assert err.value.body["error"]["type"] == "not_found_error"


def test_a_prompt_past_the_context_is_too_long_in_anthropics_words(client):
    """Claude Code recognizes an overflow (and compacts) only by Anthropic's wording."""
    long = [{"role": "user", "content": "word " * 1500}]
    for stream in (False, True):
        with pytest.raises(anthropic.BadRequestError) as err:
            client.messages.create(model="s", max_tokens=5, messages=long, stream=stream)
        error = err.value.body["error"]
        assert error["type"] == "invalid_request_error"
        match = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum",
                             error["message"])
        assert match and int(match[1]) > 1500 and int(match[2]) <= 1024, error


def test_empty_content_is_refused_but_in_a_final_assistant_turn(client):
    """As Anthropic: content [] (or "") is a 400 naming the message; it was accepted."""
    for content in ([], ""):
        with pytest.raises(anthropic.BadRequestError) as err:
            client.messages.create(model="s", max_tokens=5, messages=[
                {"role": "user", "content": content}])
        assert err.value.body["error"]["message"].startswith("messages[0].content")
    r = client.messages.create(model="s", max_tokens=5, messages=[
        *ASK, {"role": "assistant", "content": []}], **GREEDY)
    assert r.stop_reason is not None


def test_a_final_assistant_message_is_continued(client):
    """Anthropic's prefill: the answer goes on from the assistant's text (the script's next
    token after "is" is " five"); it used to be followed by a new turn, which wrote the whole
    script again. Trailing whitespace there is a 400, as Anthropic answers."""
    begun = [*ASK, {"role": "assistant", "content": "The answer is"}]
    r = client.messages.create(model="s", max_tokens=8, messages=begun, **GREEDY)
    assert [b.text for b in r.content] == [" five"] and r.stop_reason == "end_turn"
    streamed = client.messages.create(model="s", max_tokens=8, messages=begun, stream=True,
                                      **GREEDY)
    assert "".join(e.delta.text for e in streamed if e.type == "content_block_delta") == " five"
    counted = client.messages.count_tokens(model="s", messages=begun).input_tokens
    assert counted == r.usage.input_tokens + r.usage.cache_read_input_tokens
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="s", max_tokens=8, messages=[
            *ASK, {"role": "assistant", "content": "The answer is "}])
    assert "trailing whitespace" in err.value.body["error"]["message"]


def test_message_start_splits_the_input_as_message_delta(client):
    """Asked twice, the prompt is cached the second time: message_start's usage says so as
    message_delta's does (it said nothing was cached: it was sent before the engine knew)."""
    for _ in range(2):
        events = list(client.messages.create(model="s", max_tokens=20, messages=ASK,
                                             stream=True, **GREEDY))
    start, end = events[0].message.usage, events[-2].usage
    assert start.cache_read_input_tokens > 0
    assert (start.input_tokens, start.cache_read_input_tokens) == \
        (end.input_tokens, end.cache_read_input_tokens)


def test_the_key_as_x_api_key_or_bearer(plain):
    bearer = _client(plain, api_key=None, auth_token=KEY)  # Authorization: Bearer
    assert bearer.messages.count_tokens(model="s", messages=ASK).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as err:
        _client(plain, api_key="wrong").messages.create(model="s", max_tokens=5, messages=ASK)
    assert err.value.body["error"]["type"] == "authentication_error"


# ---------------------------------------------------------------- thinking and tools


def test_thinking_text_and_a_tool_call(tooling):
    r = tooling.messages.create(model="s", max_tokens=40, messages=WEATHER_ASK, tools=[WEATHER],
                                thinking=THINK, **GREEDY)
    assert [b.type for b in r.content] == ["thinking", "text", "tool_use"]
    thinking, text, call = r.content
    assert (thinking.thinking, thinking.signature, text.text) == (THOUGHT, "", SAYS)
    assert call.id.startswith("toolu_") and (call.name, call.input) == \
        ("get_weather", {"city": "Rome"})
    assert (r.stop_reason, r.stop_sequence) == ("tool_use", None)


def test_thinking_text_and_a_tool_call_streamed(tooling):
    events = list(tooling.messages.create(model="s", max_tokens=40, messages=WEATHER_ASK,
                                          tools=[WEATHER], thinking=THINK, stream=True,
                                          **GREEDY))
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in starts] == ["thinking", "text", "tool_use"]
    assert starts[2].name == "get_weather" and starts[2].id.startswith("toolu_")
    by_block: dict[int, list] = {}
    for e in events:
        if e.type == "content_block_delta":
            by_block.setdefault(e.index, []).append(e.delta)
    assert "".join(d.thinking for d in by_block[0]) == THOUGHT
    assert "".join(d.text for d in by_block[1]) == SAYS
    assert {d.type for d in by_block[2]} == {"input_json_delta"}
    assert json.loads("".join(d.partial_json for d in by_block[2])) == {"city": "Rome"}
    stops = [e.index for e in events if e.type == "content_block_stop"]
    assert stops == [0, 1, 2]
    assert events[-2].delta.stop_reason == "tool_use" and events[-1].type == "message_stop"
    with tooling.messages.stream(model="s", max_tokens=40, messages=WEATHER_ASK,
                                 tools=[WEATHER], thinking=THINK, **GREEDY) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == {"city": "Rome"}


def test_a_tool_result_sent_back(tooling):
    first = tooling.messages.create(model="s", max_tokens=40, messages=WEATHER_ASK,
                                    tools=[WEATHER], thinking=THINK, **GREEDY)
    call = first.content[2]
    messages = [*WEATHER_ASK, {"role": "assistant", "content": first.content},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 24C"},
                    {"type": "text", "text": "Thanks."}]}]
    r = tooling.messages.create(model="s", max_tokens=40, messages=messages, tools=[WEATHER],
                                thinking=THINK, tool_choice={"type": "auto"}, **GREEDY)
    assert r.stop_reason == "tool_use"  # the script again: accepted, rendered, run
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens > \
        first.usage.input_tokens + first.usage.cache_read_input_tokens


def test_without_tools_the_call_is_text(tooling):
    r = tooling.messages.create(model="s", max_tokens=40, messages=WEATHER_ASK,
                                thinking={"type": "disabled"}, **GREEDY)
    assert [b.type for b in r.content] == ["thinking", "text"]  # qwen3 reads what it writes
    assert r.content[1].text.startswith(SAYS + "<tool_call>")
    assert r.stop_reason == "end_turn"
