"""Tool calling: request validation, grammar schemas, and the streaming output parser."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import pytest

from deepinfer.frontend.server.errors import APIError
from deepinfer.frontend.server.parsers.tool_calls.parser import ParsedDelta, ToolCallParser
from deepinfer.frontend.server.parsers.tool_calls.tools import ToolSetup, parse_tools

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}


def tool(name: str, parameters: dict | None = None, **extra) -> dict:
    fn = {"name": name, **extra}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


TOOLS = [tool("get_weather", WEATHER_PARAMS, description="Weather"), tool("get-time")]


def setup(tool_choice=None, parallel=None) -> ToolSetup:
    result = parse_tools(TOOLS, tool_choice, parallel)
    assert result is not None
    return result


# --- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ({"type": "function"}, "tools"),
        (["get_weather"], "tools[0]"),
        ([{"type": "retrieval", "function": {"name": "f"}}], "tools[0].type"),
        ([{"type": "function"}], "tools[0].function"),
        ([tool("ok"), tool("has space")], "tools[1].function.name"),
        ([tool("ok"), tool("x" * 65)], "tools[1].function.name"),
        ([tool("ok"), tool("")], "tools[1].function.name"),
        ([tool("ok"), {"type": "function", "function": {"name": 3}}], "tools[1].function.name"),
        ([tool("ok"), {"type": "function", "function": {}}], "tools[1].function.name"),
        ([tool("ok"), tool("ok")], "tools[1].function.name"),
        ([tool("f", ["not", "a", "schema"])], "tools[0].function.parameters"),
        ([tool("f", description=5)], "tools[0].function.description"),
        ([tool("f", strict="yes")], "tools[0].function.strict"),
    ],
)
def test_invalid_tools_name_the_field(tools, param):
    with pytest.raises(APIError) as err:
        parse_tools(tools, None, None)
    assert err.value.param == param
    assert err.value.status == 400
    assert err.value.message


@pytest.mark.parametrize(
    ("tools", "tool_choice"),
    [
        (TOOLS, "sometimes"),
        (TOOLS, 3),
        (TOOLS, {"type": "function", "function": {"name": "unknown_fn"}}),
        (TOOLS, {"type": "function"}),
        (TOOLS, {"type": "other", "function": {"name": "get_weather"}}),
        (TOOLS, {"function": {"name": "get_weather"}}),
        (None, "required"),
        ([], "required"),
        (None, {"type": "function", "function": {"name": "get_weather"}}),
    ],
)
def test_invalid_tool_choice(tools, tool_choice):
    with pytest.raises(APIError) as err:
        parse_tools(tools, tool_choice, None)
    assert err.value.param == "tool_choice"


def test_invalid_parallel_tool_calls():
    with pytest.raises(APIError) as err:
        parse_tools(TOOLS, None, "yes")
    assert err.value.param == "parallel_tool_calls"


def test_no_tools_means_no_setup():
    assert parse_tools(None, None, None) is None
    assert parse_tools(None, "none", None) is None
    assert parse_tools([], "none", True) is None
    assert parse_tools(None, "auto", None) is None  # nothing to call: plain chat


def test_defaults_and_modes():
    auto = setup()
    assert (auto.mode, auto.named, auto.parallel) == ("auto", None, True)
    assert auto.functions == [
        {"name": "get_weather", "description": "Weather", "parameters": WEATHER_PARAMS},
        {"name": "get-time", "description": "", "parameters": {"type": "object", "properties": {}}},
    ]
    assert setup("none").mode == "none"
    assert setup("required", parallel=False).parallel is False
    named = setup({"type": "function", "function": {"name": "get-time"}})
    assert (named.mode, named.named) == ("named", "get-time")


def test_render_tools():
    assert setup("none").render_tools() is None
    rendered = setup().render_tools()
    assert rendered == [{"type": "function", "function": f} for f in setup().functions]
    assert setup("required").render_tools() == rendered


# --- grammar schemas ---------------------------------------------------------------------------


def valid(schema: dict, instance) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


def test_required_schema_accepts_only_calls():
    schema = setup("required").grammar_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    for alt in schema["items"]["anyOf"]:
        assert list(alt["properties"]) == ["name", "arguments"]  # name is generated first
    weather = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}
    assert valid(schema, [weather])
    assert valid(schema, [weather, {"name": "get-time", "arguments": {}}])
    assert not valid(schema, [])
    assert not valid(schema, [{"name": "nope", "arguments": {}}])
    assert not valid(schema, [{"name": "get_weather"}])
    assert not valid(schema, [{"name": "get_weather", "arguments": {"days": 2}}])
    assert not valid(schema, [{**weather, "extra": 1}])
    assert not valid(schema, weather)


def test_required_schema_without_parallel_allows_one_call():
    schema = setup("required", parallel=False).grammar_schema()
    assert schema["maxItems"] == 1
    call = {"name": "get-time", "arguments": {}}
    assert valid(schema, [call])
    assert not valid(schema, [call, call])


def test_named_and_free_schemas():
    named = setup({"type": "function", "function": {"name": "get_weather"}})
    assert named.grammar_schema() == WEATHER_PARAMS
    assert valid(named.grammar_schema(), {"city": "Oslo"})
    assert not valid(named.grammar_schema(), {"days": 1})
    assert setup("auto").grammar_schema() is None
    assert setup("none").grammar_schema() is None


# --- parser helpers ----------------------------------------------------------------------------


def chunkings(text: str) -> Iterator[list[str]]:
    """The text whole, split once at every boundary, twice at every pair, and per character."""
    n = len(text)
    yield [text]
    for i in range(n + 1):
        yield [text[:i], text[i:]]
    step = max(1, n // 40)  # keep the pairs to ~800 per text
    for i in range(0, n + 1, step):
        for j in range(i, n + 1, step):
            yield [text[:i], text[i:j], text[j:]]
    yield list(text)


def run(tool_setup: ToolSetup | None, chunks: list[str]):
    parser = ToolCallParser(tool_setup)
    deltas: list[ParsedDelta] = [parser.feed(chunk) for chunk in chunks]
    deltas.append(parser.finish())
    return parser, deltas


def check_stream(parser: ToolCallParser, deltas: list[ParsedDelta]) -> None:
    """The deltas add up to the final result, in the same order; each call goes out whole in
    one delta, with arguments that are a JSON object."""
    assert "".join(d.content for d in deltas) == parser.content
    assert [p for d in deltas for p in d.parts] == parser.parts
    calls = parser.calls
    fragments: dict[int, list[str]] = {}
    for delta in (c for d in deltas for c in d.calls):
        if delta.index not in fragments:
            assert delta.index == len(fragments)  # indices count from 0 in order
            assert delta.id == calls[delta.index].id
            assert delta.name == calls[delta.index].name
            fragments[delta.index] = []
        else:
            raise AssertionError(f"call {delta.index} went out in more than one delta")
        fragments[delta.index].append(delta.arguments)
    assert len(fragments) == len(calls)
    for i, call in enumerate(calls):
        assert "".join(fragments[i]) == call.arguments
        assert isinstance(json.loads(call.arguments), dict)
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    assert len({c.id for c in calls}) == len(calls)


def check_all_chunkings(tool_setup, text, content, calls):
    """Every way of splitting `text` gives `content` and `calls` as [(name, arguments dict)]."""
    for chunks in chunkings(text):
        parser, deltas = run(tool_setup, chunks)
        check_stream(parser, deltas)
        assert parser.content == content, chunks
        assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == calls, chunks


# --- mode none ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tool_setup", [None, setup("none")])
def test_none_mode_is_all_content(tool_setup):
    text = 'Hi <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    check_all_chunkings(tool_setup, text, text, [])
    parser = ToolCallParser(tool_setup)
    assert parser.feed("abc").content == "abc"


# --- mode named --------------------------------------------------------------------------------

NAMED_ARGS = '{"city": "Pa\\"ris {x} \\\\ \\u00e9", "days": 3, "extra": [1, {"a": "]"}]}'


def test_named_mode_sends_the_call_whole_at_the_end():
    """The call goes out once its arguments are known to parse (they used to stream as the
    model wrote them, and a call cut short by max_tokens then reached the client with arguments
    that are no JSON: issue 53)."""
    named = setup({"type": "function", "function": {"name": "get_weather"}})
    expected = [("get_weather", json.loads(NAMED_ARGS))]
    check_all_chunkings(named, NAMED_ARGS, "", expected)
    parser = ToolCallParser(named)
    assert parser.feed('{"ci').calls == []
    assert parser.feed('ty": "Oslo"}').calls == []
    (done,) = parser.finish().calls
    assert (done.index, done.name, done.arguments) == (0, "get_weather", '{"city": "Oslo"}')
    assert done.id is not None
    assert parser.calls[0].arguments == '{"city": "Oslo"}'


@pytest.mark.parametrize("text", ["", '{"city": "Ro', "[1]"])
def test_named_mode_cut_short_is_content(text):
    """Arguments that do not parse (max_tokens cut them, or nothing came) are no call: the text
    is the answer (it used to be a call with those arguments)."""
    named = setup({"type": "function", "function": {"name": "get_weather"}})
    check_all_chunkings(named, text, text, [])


# --- mode required -----------------------------------------------------------------------------

REQUIRED_TEXT = (
    ' [ {"name": "get_weather", "arguments": {"city": "Pa\\"ris {}[]", "days": 2}} ,\n'
    '{ "name" : "get-time" , "arguments" : { "tz": "\\\\\\u00e9}", "n": [1, {"x": null}] } }]'
)


def test_required_mode_multiple_calls_with_escapes():
    expected = [
        ("get_weather", {"city": 'Pa"ris {}[]', "days": 2}),
        ("get-time", {"tz": "\\é}", "n": [1, {"x": None}]}),
    ]
    check_all_chunkings(setup("required"), REQUIRED_TEXT, "", expected)


def test_required_mode_arguments_are_compact_json():
    parser, _ = run(setup("required"), [REQUIRED_TEXT])
    assert [c.arguments for c in parser.calls] == [
        '{"city":"Pa\\"ris {}[]","days":2}',
        '{"tz":"\\\\é}","n":[1,{"x":null}]}',
    ]


def test_required_mode_arguments_before_name_are_held():
    text = '[{"arguments": {"city": "}\\"{"}, "name": "get_weather"}]'
    check_all_chunkings(setup("required"), text, "", [("get_weather", {"city": '}"{'})])
    parser = ToolCallParser(setup("required"))
    assert parser.feed('[{"arguments": {"city": "x"}, "na').calls == []
    first = parser.feed('me": "get_weather"}]').calls
    assert [(d.name, d.arguments) for d in first] == [("get_weather", '{"city":"x"}')]


def test_required_mode_sends_each_call_as_its_item_closes():
    parser = ToolCallParser(setup("required"))
    assert parser.feed('[{"name": "get_wea').calls == []
    assert parser.feed('ther", "arguments": {"city": "Par').calls == []
    (first,) = parser.feed('is"}}, {"name": "get-').calls
    assert (first.index, first.name, first.arguments) == (0, "get_weather", '{"city":"Paris"}')
    assert first.id is not None
    (second,) = parser.feed('time", "arguments": {}}]').calls
    assert (second.index, second.name, second.arguments) == (1, "get-time", "{}")
    assert parser.finish().content == ""
    assert parser.content == ""


def test_required_mode_cut_short_leaves_the_unfinished_item_as_content():
    """max_tokens ended the array inside an item: the calls before it stand, the rest is text
    (it used to go out as a call whose arguments never closed)."""
    first = '[{"name": "get-time", "arguments": {}}'
    rest = ', {"name": "get_weather", "arguments": {"city": "Ro'
    check_all_chunkings(setup("required"), first + rest, rest, [("get-time", {})])
    check_all_chunkings(setup("required"), rest[2:], rest[2:], [])


# --- mode auto ---------------------------------------------------------------------------------


def test_auto_blocks_with_surrounding_content():
    text = (
        "Let me check. <tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "S\\u00e3o {Paulo}"}}\n'
        "</tool_call>\n<tool_call>"
        '{"name": "get-time", "parameters": {}}</tool_call> Done < ok'
    )
    expected = [("get_weather", {"city": "São {Paulo}"}), ("get-time", {})]
    check_all_chunkings(setup(), text, "Let me check. \n Done < ok", expected)
    parser, _ = run(setup(), [text])
    assert parser.calls[0].arguments == '{"city":"São {Paulo}"}'  # compact, unicode kept


def test_auto_call_is_emitted_whole_when_the_block_closes():
    parser = ToolCallParser(setup())
    assert parser.feed("Hi ").content == "Hi "
    assert parser.feed('<tool_call>{"name": "get-time", ').calls == []
    done = parser.feed('"arguments": {"a": 1}}</tool_call>')
    assert [(d.index, d.name, d.arguments) for d in done.calls] == [(0, "get-time", '{"a":1}')]
    assert done.calls[0].id is not None


def test_auto_string_arguments_are_kept_verbatim():
    text = '<tool_call>{"name": "get-time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>'
    parser, _ = run(setup(), [text])
    assert [(c.name, c.arguments) for c in parser.calls] == [("get-time", '{"tz": "UTC"}')]


def test_auto_partial_tag_at_chunk_boundary_is_held():
    parser = ToolCallParser(setup())
    assert parser.feed("Hello <tool").content == "Hello "
    assert parser.feed("_call>").content == ""
    done = parser.feed('{"name": "get-time", "arguments": {}}</tool_call>')
    assert [c.name for c in done.calls] == ["get-time"]
    # a held "<" that turns out not to be a tag is released as content
    assert parser.feed(" a <").content == " a "
    assert parser.feed(" b").content == "< b"
    assert parser.feed("<tool_c").content == ""
    assert parser.finish().content == "<tool_c"
    assert parser.content == "Hello  a < b<tool_c"


def test_auto_unparseable_block_stays_content():
    """...however it streams. A call goes out only once its block is whole and parses (it used
    to go out once its name and the start of its arguments were seen, as vLLM's parsers do, and
    a malformed one then reached the client as a call with arguments that are no JSON)."""
    text = 'A <tool_call>{"name": "get-time", "arguments": {</tool_call> B'
    check_all_chunkings(setup(), text, text, [])
    no_name = '<tool_call>{"arguments": {}}</tool_call>'
    check_all_chunkings(setup(), no_name, no_name, [])
    not_object = '<tool_call>{"name": "get-time", "arguments": "[1]"}</tool_call>'
    check_all_chunkings(setup(), not_object, not_object, [])


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "launch", "arguments": {"a": 1}}',  # unclosed, decided at finish
    '{"name": "launch", "arguments": {}}',  # bare JSON
])
def test_auto_call_to_an_undeclared_function_is_content(text):
    """A client can do nothing with a call to a function it did not declare (openai-agents
    raised ModelBehaviorError, Codex looped on "unsupported call"): it is text."""
    check_all_chunkings(setup(), text, text, [])


def test_auto_text_after_a_call_follows_it():
    """One feed that ends a call and carries text after it hands them out in that order."""
    parser = ToolCallParser(setup())
    assert parser.feed('Hi <tool_call>{"name": "get-time", "arguments": {').parts == ["Hi "]
    parts = parser.feed('}}</tool_call> Done').parts
    assert [p if isinstance(p, str) else (p.name, p.arguments) for p in parts] == [
        ("get-time", "{}"), " Done"]


def test_auto_unclosed_block_is_decided_at_finish():
    text = 'x <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}'
    check_all_chunkings(setup(), text, "x ", [("get_weather", {"city": "Rome"})])
    broken = 'x <tool_call>{"name": "get_weather", "argu'
    check_all_chunkings(setup(), broken, broken, [])


def test_auto_bare_json_call():
    text = '\n {"name": "get_weather", "arguments": {"city": "Lima", "days": 1}} \n'
    check_all_chunkings(setup(), text, "", [("get_weather", {"city": "Lima", "days": 1})])
    parser = ToolCallParser(setup())
    assert parser.feed(text).content == ""  # held back until finish decides
    assert [c.name for c in parser.finish().calls] == ["get_weather"]


def test_auto_bare_json_that_is_not_a_call_is_content():
    unknown = '{"name": "launch", "arguments": {}}'
    check_all_chunkings(setup(), unknown, unknown, [])
    not_alone = '{"name": "get-time", "arguments": {}} and more'
    check_all_chunkings(setup(), not_alone, not_alone, [])
    then_block = ' {"a": 1} <tool_call>{"name": "get-time", "arguments": {}}</tool_call>'
    check_all_chunkings(setup(), then_block, ' {"a": 1} ', [("get-time", {})])


def test_auto_whitespace_only_output_is_content():
    check_all_chunkings(setup(), " \n ", " \n ", [])
    parser = ToolCallParser(setup())
    assert parser.feed("  ").content == ""  # could still turn into a bare JSON call
    assert parser.feed("ok").content == "  ok"


def test_finish_is_final():
    parser = ToolCallParser(setup())
    parser.feed("hi")
    assert parser.finish().content == ""
    assert parser.finish() == ParsedDelta()
    with pytest.raises(RuntimeError):
        parser.feed("more")
