"""Structured output end to end: a real `deepinfer serve` of the default model (with n-gram
speculation on, so drafts meet the grammar too), the real `openai` client, outputs checked by
`jsonschema`, `re.fullmatch` and the tools' parameter schemas."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

from scripts.server_process import ServerProcess
from scripts.structured_schemas import SCHEMAS

MODEL = "smol"
SYSTEM = {"role": "system", "content": "You answer with JSON only."}


@pytest.fixture(scope="module")
def server(default_model):
    srv = ServerProcess(default_model, "--served-model-name", MODEL, "--max-model-len", "2048",
                        "--num-kv-blocks", "1024", "--speculative-method", "ngram")
    yield srv
    assert srv.stop() == 0, srv.output()


class Client:
    """An AsyncOpenAI client per event loop (each test body runs its own)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self._clients: dict[int, openai.AsyncOpenAI] = {}

    def __getattr__(self, name):
        loop = id(asyncio.get_running_loop())
        if loop not in self._clients:
            self._clients[loop] = openai.AsyncOpenAI(base_url=self.base_url, api_key="none",
                                                     max_retries=0, timeout=300)
        return getattr(self._clients[loop], name)

    def run(self, coro):
        """Run `coro` in a fresh event loop, closing this loop's client at the end."""
        async def main():
            try:
                return await coro
            finally:
                made = self._clients.pop(id(asyncio.get_running_loop()), None)
                if made is not None:
                    await made.close()

        return asyncio.run(main())


@pytest.fixture
def client(server):
    return Client(f"{server.base_url}/v1")


async def chat(client, messages, stream: bool, **kw) -> tuple[str, str, list]:
    """(content, finish_reason, tool calls as dicts) of choice 0, streamed or not."""
    if not stream:
        r = await client.chat.completions.create(model=MODEL, messages=messages, **kw)
        msg = r.choices[0].message
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in msg.tool_calls or []]
        return msg.content or "", r.choices[0].finish_reason, calls
    text, finish, calls = [], None, {}
    async for chunk in await client.chat.completions.create(
            model=MODEL, messages=messages, stream=True, **kw):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        text.append(c.delta.content or "")
        for d in c.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:
                assert call["id"] is None, "a call's id comes once"
                call["id"], call["name"] = d.id, d.function.name
            call["arguments"] += d.function.arguments or ""
        finish = c.finish_reason or finish
    return "".join(text), finish, [calls[i] for i in sorted(calls)]


def kwargs(temperature: float, i: int) -> dict:
    # Half the requests opt out of speculation: both paths meet the grammar.
    return dict(temperature=temperature, seed=i, max_tokens=200,
                extra_body={"speculative_decoding": i % 2 == 0})


def spec_counters(server) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics").text
    return {k: float(v) for k, v in re.findall(r"^(deepinfer_spec_decode_\w+) (\S+)$", text, re.M)}


def test_json_schemas_validate_greedy_and_sampled_streaming_or_not(server, client):
    before = spec_counters(server)

    async def one(i: int, what: str, schema: dict, temperature: float, stream: bool):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                      "strict": True}}
        messages = [SYSTEM, {"role": "user", "content": f"Give me {what}."}]
        text, finish, _ = await chat(client, messages, stream, response_format=fmt,
                                     **kwargs(temperature, i))
        return what, temperature, stream, text, finish

    jobs = [one(i, what, schema, t, stream)
            for i, (what, schema) in enumerate(SCHEMAS)
            for t in (0.0, 1.0) for stream in (False, True)]

    async def all_jobs():
        return await asyncio.gather(*jobs)

    results = client.run(all_jobs())
    assert len(results) >= 80
    schemas = dict(SCHEMAS)
    for what, temperature, stream, text, finish in results:
        where = f"{what!r} t={temperature} stream={stream}: {text!r}"
        assert finish == "stop", where
        jsonschema.validate(json.loads(text), schemas[what])
    # Greedy answers do not depend on streaming.
    greedy = {(w, s): text for w, t, s, text, _ in results if t == 0.0}
    assert all(greedy[(w, False)] == greedy[(w, True)] for w, _ in SCHEMAS)
    after = spec_counters(server)
    drafts = "deepinfer_spec_decode_draft_tokens_total"
    assert after[drafts] > before[drafts]  # drafts were proposed and checked under grammars


def test_completions_with_guided_json_and_response_format(client):
    async def one(i: int, what: str, schema: dict, field: str):
        extra = ({"guided_json": schema} if field == "guided_json" else
                 {"response_format": {"type": "json_schema",
                                      "json_schema": {"name": "x", "schema": schema}}})
        r = await client.completions.create(
            model=MODEL, prompt=f"Here is {what} as JSON: ", max_tokens=200, temperature=1.0,
            seed=i, extra_body=extra)
        return schema, r.choices[0].text, r.choices[0].finish_reason

    async def all_jobs():
        return await asyncio.gather(*(one(i, w, s, f) for i, (w, s) in enumerate(SCHEMAS[:8])
                                      for f in ("guided_json", "response_format")))

    for schema, text, finish in client.run(all_jobs()):
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_json_object_regex_choice_and_ebnf(client):
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    choices = ["positive", "negative", "neutral \"maybe\""]
    grammar = 'root ::= num (" + " num)* " = ?"\nnum ::= [1-9] [0-9]?'
    cases = [
        ("Reply with a JSON object with two keys: a cat's name and its age.",
         {"response_format": {"type": "json_object"}},
         lambda text: isinstance(json.loads(text), dict)),
        ("My phone number is", {"extra_body": {"guided_regex": phone}},
         lambda text: re.fullmatch(phone, text) is not None),
        ("Is 'I love it' positive or negative?", {"extra_body": {"guided_choice": choices}},
         lambda text: text in choices),
        ("Write a sum of small numbers.", {"extra_body": {"guided_grammar": grammar}},
         lambda text: re.fullmatch(r"[1-9][0-9]?( \+ [1-9][0-9]?)* = \?", text) is not None),
    ]

    async def one(prompt, kw, check, temperature, stream, i):
        kw = {**kw, "extra_body": {**kw.get("extra_body", {}), "speculative_decoding": i % 2 == 0}}
        text, finish, _ = await chat(client, [{"role": "user", "content": prompt}], stream,
                                     temperature=temperature, seed=i, max_tokens=400, **kw)
        return prompt, text, finish, check(text)

    async def all_jobs():
        return await asyncio.gather(*(
            one(p, kw, check, t, s, i) for i, (p, kw, check) in enumerate(cases)
            for t in (0.0, 1.0) for s in (False, True)))

    for prompt, text, finish, ok in client.run(all_jobs()):
        assert finish == "stop" and ok, (prompt, text, finish)


def test_json_object_is_an_object_even_where_an_array_comes_naturally(client):
    """OpenAI's JSON mode means an object: xgrammar's builtin JSON grammar, which json_object
    had compiled to, let the model continue this prompt with [6, 7, 8, 9, 10]."""
    prompt = ("The numbers 1 to 5 as a JSON array: [1, 2, 3, 4, 5]\n"
              "The numbers 6 to 10 as a JSON array: ")

    async def one(stream: bool) -> tuple[str, str]:
        kw = dict(model=MODEL, prompt=prompt, temperature=0.0, max_tokens=60,
                  extra_body={"response_format": {"type": "json_object"}})
        if not stream:
            r = await client.completions.create(**kw)
            return r.choices[0].text, r.choices[0].finish_reason
        text, finish = [], None
        async for chunk in await client.completions.create(**kw, stream=True):
            text += [c.text for c in chunk.choices]
            finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), finish)
        return "".join(text), finish

    async def both():
        return await asyncio.gather(one(False), one(True))

    for text, finish in client.run(both()):
        assert finish == "stop" and isinstance(json.loads(text), dict), text


def test_n_choices_each_follow_the_schema(client):
    what, schema = SCHEMAS[0]

    async def go():
        return await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Give me {what}."}], n=4,
            temperature=1.0, max_tokens=100,
            response_format={"type": "json_schema", "json_schema": {"name": "p",
                                                                    "schema": schema}})

    r = client.run(go())
    assert len(r.choices) == 4
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), schema)


def test_max_tokens_cuts_a_structured_answer_with_length(client):
    async def go():
        return await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "A person?"}], max_tokens=3,
            temperature=0, extra_body={"guided_json": SCHEMAS[0][1]})

    r = client.run(go())
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 20},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a time zone.",
        "parameters": {"type": "object",
                       "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
                       "required": ["zone"], "additionalProperties": False}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Berlin?"}]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named_give_valid_calls(client, stream):
    named = {"type": "function", "function": {"name": "get_time"}}

    async def all_jobs():
        return await asyncio.gather(*(
            chat(client, ASK, stream, tools=TOOLS, tool_choice=choice, temperature=t, seed=i,
                 max_tokens=200, parallel_tool_calls=parallel)
            for i, (choice, t, parallel) in enumerate([
                ("required", 0.0, False), ("required", 1.0, False), ("required", 0.0, True),
                (named, 0.0, None), (named, 1.0, None)])))

    results = client.run(all_jobs())
    for k, (content, finish, calls) in enumerate(results):
        assert calls
        if k == 2 and finish == "length":
            # Parallel calls: this small model may keep adding calls until max_tokens; every
            # call it finished is a valid one, and the one it was writing is text (it used to
            # be a call whose arguments do not parse: issue 53).
            assert not content.strip(", \n") or content.lstrip(", \n").startswith("{")
        else:
            assert finish == "tool_calls" and not content, (content, calls)
        for call in calls:
            assert call["id"].startswith("call_")
            jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])
        if k in (0, 1):  # parallel_tool_calls false: one call
            assert len(calls) == 1
        if k >= 3:  # named: exactly one call, to that function
            assert [c["name"] for c in calls] == ["get_time"]
    assert len({c["id"] for _, _, calls in results for c in calls}) == sum(
        len(calls) for _, _, calls in results)  # ids are unique


def test_tool_choice_none_and_auto_answer_in_text(client):
    async def go(choice):
        return await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hello."}], tools=TOOLS,
            tool_choice=choice, temperature=0, max_tokens=16)

    none, auto = client.run(go("none")), client.run(go("auto"))
    assert none.choices[0].message.content and not none.choices[0].message.tool_calls
    # auto: the tools were rendered into the prompt (the template's own way or Hermes-style).
    assert auto.usage.prompt_tokens > none.usage.prompt_tokens + 50
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_results_go_back_to_the_model(client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": '
                                                             '"celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"},
    ]

    async def go():
        return await client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=24)

    r = client.run(go())
    assert r.choices[0].message.content or r.choices[0].message.tool_calls


BAD = [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "invalid JSON schema"),
    ({"extra_body": {"guided_json": {"$ref": "#/$defs/missing"}}}, "invalid JSON schema"),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "invalid regex"),
    ({"extra_body": {"guided_grammar": "root ::= undefined_rule"}}, "invalid EBNF grammar"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kw, message", BAD)
def test_bad_grammars_are_a_400_before_any_token(server, client, kw, message, stream):
    async def go():
        r = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
            stream=stream, **kw)
        if stream:
            async for _ in r:
                pass

    with pytest.raises(openai.BadRequestError) as err:
        client.run(go())
    assert message in str(err.value)
    assert httpx.get(f"{server.base_url}/health").status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_auto_turns_hermes_blocks_into_tool_calls(client, stream):
    """A regex makes this small model answer with text and a Hermes-style block, the format the
    tools were described in: the block becomes a tool call, the text stays content."""
    regex = (r'Let me check\. <tool_call>\{"name": "get_time", "arguments": '
             r'\{"zone": "(UTC|CET)"\}\}</tool_call>')

    async def go():
        return await chat(client, ASK, stream, tools=TOOLS, tool_choice="auto", temperature=0,
                          max_tokens=60, extra_body={"guided_regex": regex})

    content, finish, calls = client.run(go())
    assert content == "Let me check. "
    assert finish == "tool_calls"
    assert [c["name"] for c in calls] == ["get_time"]
    assert json.loads(calls[0]["arguments"])["zone"] in ("UTC", "CET")
