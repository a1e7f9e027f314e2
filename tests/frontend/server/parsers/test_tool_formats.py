"""Per-family tool-call formats (frontend/server/parsers/tool_calls/, `--tool-call-parser`): each
family's recorded output, split every way (whole, at every boundary, per character), gives the
same content and calls; a body that is not a call stays content."""

from __future__ import annotations

import json

import pytest

from deepinfer.frontend.server.parsers.tool_calls.parser import ToolCallParser
from deepinfer.frontend.server.parsers.tool_calls.registry import (
    TOOL_CALL_PARSERS,
    format_for_template,
)
from tests.frontend.server.parsers.test_tool_calls import check_stream, chunkings, setup

B, E, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
RUN_B, RUN_E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"

# (parser, recorded output, content, calls as (name, arguments))
RECORDED = [
    ("hermes", 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
               "</tool_call>", "Sure. ", [("get_weather", {"city": "Oslo"})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}', "",
     [("get_weather", {"city": "Oslo", "days": 2})]),
    ("qwen3_xml", "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
                  "New York\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n"
                  "</tool_call>", "Checking.\n",
     [("get_weather", {"city": "New York", "days": 3})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
                    "</function>\n</tool_call>", "", [("get_weather", {"city": "42"})]),
    ("deepseek_v3", f"Let me look.{RUN_B}{B}function{SEP}get_weather\n```json\n"
                    f'{{"city": "Paris"}}\n```{E}{B}function{SEP}get-time\n```json\n{{}}\n```'
                    f"{E}{RUN_E}", "Let me look.", [("get_weather", {"city": "Paris"}),
                                                    ("get-time", {})]),
    ("deepseek_v31", f'{RUN_B}{B}get_weather{SEP}{{"city": "Rome", "days": 1}}{E}{RUN_E}', "",
     [("get_weather", {"city": "Rome", "days": 1})]),
    ("mistral", 'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                ', {"name": "get-time", "arguments": {}}]', "Let me check.",
     [("get_weather", {"city": "Oslo"}), ("get-time", {})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]get-time'
                "[ARGS]{}", "", [("get_weather", {"city": "Paris", "days": 2}), ("get-time", {})]),
    # Not a call: the block stays content, tags included.
    ("deepseek_v31", f"{B}no separator here{E} ok", f"{B}no separator here{E} ok", []),
]


def _run(name: str, chunks: list[str]) -> ToolCallParser:
    parser = ToolCallParser(setup(), TOOL_CALL_PARSERS[name])
    deltas = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
    check_stream(parser, deltas)
    return parser


@pytest.mark.parametrize(("name", "output", "content", "calls"), RECORDED)
def test_recorded_calls_parse_alike_however_the_text_streams(name, output, content, calls):
    for chunks in list(chunkings(output))[::7] + [list(output)]:
        parser = _run(name, chunks)
        assert parser.content == content, chunks
        assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == calls, chunks


def test_every_listed_name_is_a_parser():
    assert {"hermes", "llama3_json", "mistral", "qwen3_xml", "qwen3_coder", "deepseek_v3",
            "deepseek_v31"} <= set(TOOL_CALL_PARSERS)


# A call to a function the request did not declare, in each family's format: text (the
# hermes path did not check names, nor did qwen3_xml, deepseek or mistral).
UNDECLARED = [
    ("hermes", '<tool_call>{"name": "launch", "arguments": {"a": 1}}</tool_call>'),
    ("llama3_json", '{"name": "launch", "parameters": {"a": 1}}'),
    ("qwen3_xml", "<tool_call>\n<function=launch>\n<parameter=a>\n1\n</parameter>\n</function>\n"
                  "</tool_call>"),
    ("deepseek_v3", f"{B}function{SEP}launch\n```json\n{{}}\n```{E}"),
    ("deepseek_v31", f'{B}launch{SEP}{{"a": 1}}{E}'),
    ("mistral", '[TOOL_CALLS][{"name": "get-time", "arguments": {}}, {"name": "launch", '
                '"arguments": {}}]'),
    ("mistral", '[TOOL_CALLS]launch[ARGS]{"a": 1}'),
]


@pytest.mark.parametrize(("name", "output"), UNDECLARED)
def test_a_call_to_an_undeclared_function_is_text(name, output):
    for chunks in list(chunkings(output))[::5] + [list(output)]:
        parser = _run(name, chunks)
        assert (parser.content, parser.calls) == (output, []), chunks


# Malformed in each family's format: text, never a call with arguments that do not parse.
MALFORMED = [
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"</tool_call>'),
    ("deepseek_v31", f'{B}get_weather{SEP}{{"city": "Rome"{E}'),
    ("deepseek_v3", f'{B}function{SEP}get_weather\n```json\n{{"city": "Rome"\n```{E}'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"'),
]


@pytest.mark.parametrize(("name", "output"), MALFORMED)
def test_a_malformed_call_is_text_however_it_streams(name, output):
    for chunks in list(chunkings(output))[::5] + [list(output)]:
        parser = _run(name, chunks)
        assert (parser.content, parser.calls) == (output, []), chunks


@pytest.mark.parametrize(("name", "output", "content", "calls"),
                         [r for r in RECORDED if r[3] and r[0] != "llama3_json"])
def test_a_call_goes_out_whole_when_its_block_ends(name, output, content, calls):
    """Fed a character at a time, each call goes out in one delta with all its arguments (they
    used to stream as written; a call that then turned out malformed could not be taken back:
    issue 53)."""
    parser = ToolCallParser(setup(), TOOL_CALL_PARSERS[name])
    deltas = [d for c in output for d in parser.feed(c).calls] + parser.finish().calls
    assert [(d.index, d.name, json.loads(d.arguments)) for d in deltas] == \
        [(i, n, a) for i, (n, a) in enumerate(calls)]
    assert all(d.id is not None for d in deltas)


def test_qwen3_xml_parameter_written_twice_is_still_json():
    """Streamed, the second value used to be appended to what was sent for the first: invalid
    JSON. Whole calls take the last value, streamed or not."""
    output = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
              "<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>")
    for chunks in list(chunkings(output))[::5] + [list(output)]:
        parser = _run("qwen3_xml", chunks)
        assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == \
            [("get_weather", {"city": "Oslo"})]


def test_the_chat_endpoint_reads_calls_in_the_servers_format(engine):
    from starlette.testclient import TestClient

    from deepinfer.frontend.server.app import build_app
    from deepinfer.frontend.server.state import ServerState
    from tests.frontend.server.fake_engine import chat, sse
    from tests.frontend.server.parsers.test_tool_calls import TOOLS

    engine.script = ["Checking.", RUN_B, B, "get_weather", SEP, '{"city": ', '"Rome"}', E, RUN_E]
    state = ServerState(max_pending=8, tool_call_parser="deepseek_v31")
    with TestClient(build_app(state, lambda: engine)) as http:
        message = chat(http, max_tokens=20, tools=TOOLS).json()["choices"][0]["message"]
        chunks = sse(chat(http, max_tokens=20, tools=TOOLS, stream=True))
    assert message["content"] == "Checking."
    call = message["tool_calls"][0]["function"]
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Rome"})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking."
    streamed = [t for d in deltas for t in d.get("tool_calls") or []]
    assert streamed[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(t["function"]["arguments"] for t in streamed)) == {"city": "Rome"}


@pytest.mark.parametrize(("template", "name"), [
    ("{{ '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + "
     "tool['function']['name'] + '\\n```json\\n' }}", "deepseek_v3"),
    ("{{ '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + "
     "'<｜tool▁sep｜>' + tool['function']['arguments'] }}", "deepseek_v31"),
    ("{{ '<tool_call>\\n<function=' + name + '>\\n<parameter=' + key + '>' }}", "qwen3_xml"),
    ("{{ '<tool_call>' + call | tojson + '</tool_call>' }}", "hermes"),
    (None, "hermes"),
])
def test_the_parser_follows_the_chat_template(template, name):
    assert format_for_template(template) == name
