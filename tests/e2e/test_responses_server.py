"""OpenAI's Responses API end to end: real `deepinfer serve` processes and the real `openai`
SDK (`client.responses.create / stream / retrieve / delete`).

Scripted checkpoints (scripts/scripted_model.py) make the greedy reply a fixed text: a
reasoning block then an answer (with --reasoning-parser qwen3), or a sentence then a hermes
`<tool_call>` (whose JSON is a few added tokens, since every token of a script must be unique).
A plain tiny random model checks that text.format's json_schema holds the output to it.
A continuation's prompt is checked against the chat request of the same conversation.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from scripts.scripted_model import save_scripted_model
from scripts.server_process import ServerProcess

REASONING, ANSWER = "Adding two and three", "The answer is five"
ASK = "What is two plus three?"
CALL_TOKENS = ("<tool_call>", '{"name": "get_weather", "arguments": ', '{"city": ', '"Rome"}}',
               "</tool_call>")
TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}]
WEATHER = "Weather in Rome?"


def _start(model, *args: str) -> tuple[ServerProcess, openai.OpenAI]:
    srv = ServerProcess(model, "--num-kv-blocks", "64", "--served-model-name", "s", *args)
    return srv, openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="none", max_retries=0,
                              timeout=60)


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    model = save_scripted_model(tmp_path_factory.mktemp("thinker") / "model",
                                f"<think>{REASONING}</think>{ANSWER}", ("<think>", "</think>"))
    srv, client = _start(model, "--reasoning-parser", "qwen3")
    yield client
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def caller(tmp_path_factory):
    model = save_scripted_model(tmp_path_factory.mktemp("caller") / "model",
                                "Checking." + "".join(CALL_TOKENS), CALL_TOKENS)
    srv, client = _start(model, "--tool-call-parser", "hermes", "--responses-store-size", "1")
    yield client
    assert srv.stop() == 0, srv.output()


def create(client: openai.OpenAI, **kw):
    return client.responses.create(model="s", temperature=0, **(dict(max_output_tokens=40) | kw))


def test_a_reply_with_its_reasoning(thinker):
    r = create(thinker, input=ASK)
    assert r.status == "completed" and r.id.startswith("resp_")
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == REASONING
    assert r.output_text == ANSWER
    assert r.usage.output_tokens > 0 and r.usage.total_tokens == \
        r.usage.input_tokens + r.usage.output_tokens


def test_a_streamed_reply(thinker):
    with thinker.responses.stream(model="s", input=ASK, max_output_tokens=40,
                                  temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type.removeprefix("response.") for e in events]
    assert kinds[:2] == ["created", "in_progress"] and kinds[-1] == "completed"
    assert [k for k in kinds if "item" in k or "part" in k] == [
        "output_item.added", "content_part.added", "content_part.done", "output_item.done"] * 2
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert (thought, text, final.output_text) == (REASONING, ANSWER, ANSWER)


def test_max_output_tokens_cuts_it_short(thinker):
    r = create(thinker, input=ASK, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3
    events = list(create(thinker, input=ASK, max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_a_continuation_prompts_with_the_stored_conversation(thinker):
    first = create(thinker, input=ASK)
    second = create(thinker, input="And two plus four?", previous_response_id=first.id)
    assert second.previous_response_id == first.id and second.output_text == ANSWER
    # Exactly the prompt of the same conversation as a chat request.
    chat = thinker.chat.completions.create(model="s", max_tokens=1, messages=[
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": ANSWER, "reasoning_content": REASONING},
        {"role": "user", "content": "And two plus four?"}])
    assert second.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens


def test_retrieve_then_delete(thinker):
    r = create(thinker, input=ASK, metadata={"case": "retrieve"})
    got = thinker.responses.retrieve(r.id)
    assert (got.id, got.output_text, got.metadata) == (r.id, ANSWER, {"case": "retrieve"})
    thinker.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        thinker.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as err:
        create(thinker, input=ASK, previous_response_id=r.id)
    assert err.value.body["param"] == "previous_response_id"


def test_a_bad_field_is_a_bad_request(thinker):
    with pytest.raises(openai.BadRequestError) as err:
        create(thinker, input=ASK, extra_body={"max_output_tokens": "ten"})
    assert err.value.body["param"] == "max_output_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        create(thinker, input=ASK, tools=[{"type": "function"}])
    assert err.value.body["param"] == "tools[0].name"


def test_a_function_call(caller):
    r = create(caller, input=WEATHER, tools=TOOLS)
    assert [o.type for o in r.output] == ["message", "function_call"]
    assert r.output_text == "Checking."
    call = r.output[1]
    assert (call.name, json.loads(call.arguments), call.status) == (
        "get_weather", {"city": "Rome"}, "completed")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")


def test_a_streamed_function_call(caller):
    events = list(create(caller, input=WEATHER, tools=TOOLS, stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["message", "function_call"]
    assert added[1].name == "get_weather"
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    # One piece: a call goes out whole once it is known to parse (it used to stream as the
    # model wrote it, and a malformed one could not be taken back: issue 53).
    assert len(pieces) == 1, pieces
    assert "".join(pieces) == done.arguments and json.loads(done.arguments) == {"city": "Rome"}
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[1].arguments == done.arguments


def test_a_function_call_output_continues_the_conversation(caller):
    """The first response's output items sent back as they came (SDK objects), then the
    call's result: the prompt is the chat conversation's."""
    first = create(caller, input=WEATHER, tools=TOOLS)
    call = first.output[1]
    r = create(caller, tools=TOOLS, input=[{"role": "user", "content": WEATHER}, *first.output,
                                           {"type": "function_call_output",
                                            "call_id": call.call_id, "output": "sunny, 25 C"}])
    assert r.status == "completed"
    chat = caller.chat.completions.create(
        model="s", max_tokens=1, tools=[{"type": "function", "function": {
            k: v for k, v in TOOLS[0].items() if k != "type"}}],
        messages=[{"role": "user", "content": WEATHER},
                  {"role": "assistant", "content": "Checking.", "tool_calls": [
                      {"id": call.call_id, "type": "function",
                       "function": {"name": call.name, "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 25 C"}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens


def test_a_store_of_one_keeps_only_the_latest(caller):
    older = create(caller, input=WEATHER, max_output_tokens=1)
    newer = create(caller, input=WEATHER, max_output_tokens=1)
    assert caller.responses.retrieve(newer.id).id == newer.id
    with pytest.raises(openai.NotFoundError):
        caller.responses.retrieve(older.id)


SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                           "ok": {"type": "boolean"}},
          "required": ["colour", "ok"], "additionalProperties": False}


def test_json_schema_holds_a_random_model_to_it(tiny_model_dir):
    srv, client = _start(tiny_model_dir)
    try:
        r = create(client, input="Pick a colour.", text={"format": {
            "type": "json_schema", "name": "pick", "schema": SCHEMA, "strict": True}})
        jsonschema.validate(json.loads(r.output_text), SCHEMA)
        assert r.text.format.type == "json_schema"
    finally:
        assert srv.stop() == 0, srv.output()


def test_top_logprobs_are_served_as_chat_serves_them(caller):
    """top_logprobs (and include message.output_text.logprobs) give the output_text's logprobs,
    whole and streamed, the values chat's logprobs give (it was a 400)."""
    r = create(caller, input="Hi", top_logprobs=2, include=["message.output_text.logprobs"])
    text = r.output[0].content[0]
    assert [o.type for o in r.output] == ["message"] and text.text.startswith("Checking.")
    assert "".join(p.token for p in text.logprobs).startswith(text.text)  # then the EOS
    assert all(len(p.top_logprobs) == 2 for p in text.logprobs)
    chat = caller.chat.completions.create(model="s", temperature=0, max_tokens=40, logprobs=True,
                                          top_logprobs=2,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert [(p.token, round(p.logprob, 4)) for p in text.logprobs] == \
        [(p.token, round(p.logprob, 4)) for p in chat.choices[0].logprobs.content]
    with caller.responses.stream(model="s", input="Hi", max_output_tokens=40, temperature=0,
                                 top_logprobs=2) as stream:
        deltas = [p for e in stream if e.type == "response.output_text.delta" for p in e.logprobs]
        final = stream.get_final_response()
    assert [p.token for p in deltas] == [p.token for p in text.logprobs][:-1]  # not the EOS
    assert [p.token for p in final.output[0].content[0].logprobs] == \
        [p.token for p in text.logprobs]
    plain = create(caller, input="Hi")
    assert plain.output[0].content[0].logprobs == []


def test_truncation_auto_drops_the_oldest_items(thinker):
    """A chain that outgrows the 1,024-token context: with truncation "auto" every step is
    answered from the newest items that fit (it was accepted and ignored: a 400 once the chain
    no longer fit); without it, the same chain is refused."""
    long, previous = "word " * 300, None
    for _ in range(5):
        r = create(thinker, input=long, truncation="auto", previous_response_id=previous)
        assert r.status == "completed" and r.output_text == ANSWER
        assert r.usage.input_tokens + r.usage.output_tokens <= 1024
        previous = r.id
    with pytest.raises(openai.BadRequestError):
        create(thinker, input=long, previous_response_id=previous)


def test_metadata_and_a_schema_without_a_name_are_refused_as_openai_does(thinker):
    for metadata in ({f"k{i}": "v" for i in range(17)}, {"k": "v" * 513}, {"k" * 65: "v"}):
        with pytest.raises(openai.BadRequestError) as err:
            create(thinker, input=ASK, metadata=metadata)
        assert err.value.body["param"] == "metadata"
    assert create(thinker, input=ASK, metadata={"k": "v" * 512}).metadata == {"k": "v" * 512}
    unnamed = {"format": {"type": "json_schema", "schema": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as err:
        create(thinker, input=ASK, text=unnamed)
    assert err.value.body["param"] == "text.format.name"
