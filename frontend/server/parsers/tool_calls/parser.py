"""OpenAI chat-completions tool calling: validating `tools`, and parsing the model's output.

`parse_tools` checks the request's `tools` / `tool_choice` / `parallel_tool_calls` and returns a
`ToolSetup` (or None when tools play no part). `ToolCallParser` turns the generated text, fed as it
arrives, into message content and tool calls; non-streaming responses feed everything, then
`finish()`, and read `content` / `calls`, so both paths share one parser.

How the output is read depends on the mode:
- "none": everything is content.
- "named": the grammar forced the output to be the named function's arguments.
- "required": the grammar forced a JSON array `[{"name": ..., "arguments": {...}}, ...]`.
- "auto": free text with calls in the family's format (call_format.py; Hermes-style
  `<tool_call>{...}</tool_call>` by default), or a bare JSON call. A call in a block streams as
  it arrives: its name once known, then its arguments as the model writes them.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from deepinfer.frontend.server.errors import APIError
from deepinfer.frontend.server.parsers.tool_calls.call_format import (
    HERMES,
    CallFormat,
    json_call,
    loads,
)

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_DEFAULT_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass
class ToolSetup:
    mode: str  # "none" | "auto" | "required" | "named"
    functions: list[dict[str, Any]]  # each {"name", "description", "parameters"}
    named: str | None = None
    parallel: bool = True

    def grammar_schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must follow, or None when the model writes freely."""
        if self.mode == "named":
            return next(f["parameters"] for f in self.functions if f["name"] == self.named)
        if self.mode != "required":
            return None
        alternatives = [
            {
                "type": "object",
                # "name" first: the grammar generates properties in schema order, and the parser
                # can only start streaming a call once its name is known.
                "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in self.functions
        ]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": alternatives}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def render_tools(self) -> list[dict[str, Any]] | None:
        """The tools as a chat template receives them; None when the model must not call any."""
        if self.mode == "none":
            return None
        return [{"type": "function", "function": dict(f)} for f in self.functions]


def _function(i: int, tool: Any) -> dict[str, Any]:
    at = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise APIError(f"{at} must be an object", param=at)
    if tool.get("type") != "function":
        raise APIError(f"{at}.type must be 'function'", param=f"{at}.type")
    fn = tool.get("function")
    at += ".function"
    if not isinstance(fn, dict):
        raise APIError(f"{at} must be an object", param=at)
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise APIError(
            f"{at}.name must be 1-64 characters of a-z, A-Z, 0-9, '_' or '-'", param=f"{at}.name"
        )
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise APIError(f"{at}.description must be a string", param=f"{at}.description")
    parameters = fn.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise APIError(f"{at}.parameters must be a JSON schema object", param=f"{at}.parameters")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise APIError(f"{at}.strict must be a boolean", param=f"{at}.strict")
    return {
        "name": name,
        "description": description or "",
        "parameters": parameters if parameters is not None else dict(_DEFAULT_PARAMETERS),
    }


def _choice(tool_choice: str | dict | None, has_tools: bool) -> tuple[str, str | None]:
    """(mode, named function) for `tool_choice`; the name is checked against the tools later."""
    if tool_choice is None:
        return ("auto" if has_tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise APIError(
                f"tool_choice must be 'none', 'auto', 'required' or a function: {tool_choice!r}",
                param="tool_choice",
            )
        return tool_choice, None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or tool_choice.get("type") != "function":
        raise APIError(
            'tool_choice must be {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    return "named", name


def parse_tools(
    tools: list | None, tool_choice: str | dict | None, parallel_tool_calls: bool | None
) -> ToolSetup | None:
    """Validate the request's tool fields; None when no tools are given and none are forced."""
    if tools is not None and not isinstance(tools, list):
        raise APIError("tools must be an array", param="tools")
    functions: list[dict[str, Any]] = []
    for i, tool in enumerate(tools or []):
        fn = _function(i, tool)
        if any(f["name"] == fn["name"] for f in functions):
            raise APIError(
                f"duplicate function name {fn['name']!r}", param=f"tools[{i}].function.name"
            )
        functions.append(fn)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise APIError("parallel_tool_calls must be a boolean", param="parallel_tool_calls")

    mode, named = _choice(tool_choice, bool(functions))
    if not functions:
        if mode in ("required", "named"):
            raise APIError(f"tool_choice {mode!r} needs tools", param="tool_choice")
        return None  # "none" or "auto" with nothing to call: plain chat
    if named is not None and all(f["name"] != named for f in functions):
        raise APIError(f"tool_choice names unknown function {named!r}", param="tool_choice")
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    return ToolSetup(mode, functions, named, parallel)


@dataclass
class ToolCallDelta:
    index: int
    id: str | None  # only on a call's first delta
    name: str | None  # only on a call's first delta
    arguments: str  # a fragment; a call's fragments concatenate to its arguments JSON


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class ParsedDelta:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def merge(self, later: ParsedDelta) -> ParsedDelta:
        """This delta followed by `later`, as one."""
        return ParsedDelta(self.content + later.content, self.calls + later.calls)


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class _CallLog:
    """Complete calls so far, and the deltas not yet handed out (merged per call to keep few)."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.names: list[str] = []
        self.arguments: list[list[str]] = []
        self.pending: list[ToolCallDelta] = []

    def start(self, name: str, arguments: str = "") -> int:
        index = len(self.ids)
        self.ids.append(_call_id())
        self.names.append(name)
        self.arguments.append([arguments])
        self.pending.append(ToolCallDelta(index, self.ids[index], name, arguments))
        return index

    def add(self, index: int, fragment: str) -> None:
        if not fragment:
            return
        self.arguments[index].append(fragment)
        last = self.pending[-1] if self.pending else None
        if last is not None and last.index == index:
            last.arguments += fragment
        else:
            self.pending.append(ToolCallDelta(index, None, None, fragment))

    def take(self) -> list[ToolCallDelta]:
        out, self.pending = self.pending, []
        return out

    def calls(self) -> list[ToolCall]:
        return [
            ToolCall(i, n, "".join(a)) for i, n, a in zip(self.ids, self.names, self.arguments)
        ]


class _ArrayScanner:
    """Character-level reader of `[{"name": "f", "arguments": {...}}, ...]` as it streams.

    Tracks bracket depth and string/escape state; depth 2 is inside an item object, where it
    follows `"key": value` pairs. A call starts once its "name" string is complete; the raw text of
    "arguments" is streamed (held back until the name is known if it comes first).
    """

    def __init__(self, log: _CallLog) -> None:
        self.log = log
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.in_item = False
        self._new_item()

    def _new_item(self) -> None:
        self.expect = "key"  # "key" | "colon" | "value" | "comma", at depth 2
        self.key_raw: str | None = None  # the key string being read, quotes included
        self.key: str | None = None
        self.value_kind: str | None = None  # "string" | "nested" | "scalar" while in a value
        self.value_key: str | None = None
        self.name_raw = ""
        self.call: int | None = None
        self.args: list[str] = []  # arguments text not yet handed to the log
        self.saw_args = False

    def feed(self, text: str) -> None:
        for c in text:
            self._char(c)
        self._flush()

    def _char(self, c: str) -> None:
        if self.in_string:
            self._take(c)
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                if self.depth == 2:
                    self._string_closed()
            return
        if self.value_kind == "scalar" and (c in ",}]" or c.isspace()):
            self._end_value()
        if c == '"':
            if self.depth == 2 and self.expect == "key":
                self.key_raw = ""
            elif self.depth == 2 and self.expect == "value":
                self._begin_value("string")
            self.in_string = True
            self._take(c)
        elif c in "{[":
            if self.depth == 2 and self.expect == "value":
                self._begin_value("nested")
            self._take(c)
            self.depth += 1
            if self.depth == 2 and c == "{":
                self.in_item = True
                self._new_item()
        elif c in "}]":
            self._take(c)
            self.depth = max(self.depth - 1, 0)
            if self.depth == 2 and self.value_kind == "nested":
                self._end_value()
            elif self.depth == 1 and self.in_item:
                self._end_item()
        elif self.depth == 2 and self.value_kind is None:
            if c == ":" and self.expect == "colon":
                self.expect = "value"
            elif c == ",":
                self.expect = "key"
            elif self.expect == "value" and not c.isspace():
                self._begin_value("scalar")
                self._take(c)
        else:
            self._take(c)

    def _take(self, c: str) -> None:
        if self.key_raw is not None:
            self.key_raw += c
        elif self.value_key == "name":
            self.name_raw += c
        elif self.value_key == "arguments":
            self.args.append(c)

    def _string_closed(self) -> None:
        if self.key_raw is not None:
            self.key = loads(self.key_raw)
            self.key_raw = None
            self.expect = "colon"
        elif self.value_kind == "string":
            self._end_value()

    def _begin_value(self, kind: str) -> None:
        self.value_kind, self.value_key = kind, (self.key if self.in_item else None)
        self.expect = "comma"
        if self.value_key == "arguments":
            self.saw_args = True

    def _end_value(self) -> None:
        if self.value_key == "name" and self.call is None:
            name = loads(self.name_raw)
            self.call = self.log.start(name if isinstance(name, str) else self.name_raw)
            self._flush()
        self.value_kind = self.value_key = None

    def _end_item(self) -> None:
        if self.value_kind is not None:
            self._end_value()
        if self.call is not None and not self.saw_args:
            self.args.append("{}")  # the grammar requires arguments; never hand out a bare call
        self._flush()
        self.in_item = False
        self._new_item()

    def _flush(self) -> None:
        if self.call is not None and self.args:
            self.log.add(self.call, "".join(self.args))
            self.args = []


def _marker_prefix_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that could begin one of `markers`."""
    for n in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


class ToolCallParser:
    """Splits generated text into content and tool calls, incrementally."""

    def __init__(self, setup: ToolSetup | None, fmt: CallFormat = HERMES) -> None:
        """`fmt`: how the model writes a call in free text (call_format.py)."""
        self.fmt = fmt
        self.mode = setup.mode if setup is not None else "none"
        self._named = setup.named if setup is not None else None
        self._functions = {f["name"]: f for f in setup.functions} if setup is not None else {}
        self._log = _CallLog()
        self._content: list[str] = []
        self._finished = False
        self._scanner = _ArrayScanner(self._log) if self.mode == "required" else None
        # auto mode: text not yet decided, whether we are inside a block, and whether the output
        # so far is a candidate bare-JSON call (held back entirely until finish).
        self._pending = ""
        self._searched = 0
        self._in_block = False
        self._leading: str | None = ""  # output while only whitespace came; None once decided
        self._bare_json = False
        # the call of the block (or bare JSON answer) being streamed, and its arguments so far
        self._streamed: int | None = None
        self._sent = ""
        self._array: _ArrayScanner | None = None  # a block that is a JSON array of calls
        self._array_fed = 0

    @property
    def content(self) -> str:
        return "".join(self._content)

    @property
    def calls(self) -> list[ToolCall]:
        return self._log.calls()

    def feed(self, text: str) -> ParsedDelta:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if self.mode == "none":
            return self._delta(text)
        if self.mode == "named":
            if text:
                if not self._log.ids:
                    self._log.start(self._named or "")
                self._log.add(0, text)
            return self._delta("")
        if self.mode == "required":
            assert self._scanner is not None
            self._scanner.feed(text)
            return self._delta("")
        return self._delta(self._auto(text))

    def finish(self) -> ParsedDelta:
        if self._finished:
            return ParsedDelta()
        self._finished = True
        if self.mode == "named" and not self._log.ids:
            self._log.start(self._named or "")
        if self.mode != "auto":
            return self._delta("")
        if self._leading is not None:  # only whitespace ever came
            return self._delta(self._leading)
        if self._bare_json:
            call = json_call(self._pending, self._functions)
            if call is not None:
                self._log.start(*call)
                return self._delta("")
            # not a call after all: read the held text as ordinary output
            text, self._pending, self._bare_json = self._pending, "", False
            return self._delta(self._auto(text) + self._auto_end())
        return self._delta(self._auto_end())

    def _delta(self, content: str) -> ParsedDelta:
        if content:
            self._content.append(content)
        return ParsedDelta(content, self._log.take())

    def _auto(self, text: str) -> str:
        """Content that is settled after `text`; calls go to the log."""
        if self._leading is not None:
            self._leading += text
            if not self._leading.strip():
                return ""  # leading whitespace: hold until we see how the output starts
            text, self._leading = self._leading, None
            self._bare_json = text.lstrip().startswith("{")
        if self._bare_json:
            # held whole: text after the object would make it an answer, not a call
            self._pending += text
            return ""
        self._pending += text
        out: list[str] = []
        while True:
            if not self._in_block:
                for marker in self.fmt.drop:  # (whole ones: a split one is held below)
                    self._pending = self._pending.replace(marker, "")
                i = self._pending.find(self.fmt.open)
                if i < 0:
                    keep = _marker_prefix_len(self._pending, (self.fmt.open, *self.fmt.drop))
                    out.append(self._pending[: len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep:]
                    break
                out.append(self._pending[:i])
                self._pending = self._pending[i + len(self.fmt.open):]
                self._in_block, self._searched = True, 0
            else:
                # search only where the close tag could newly appear: blocks may come char by char
                # (a format without one ends a call where the next opens, which stays pending)
                close = self.fmt.close or self.fmt.open
                j = self._pending.find(close, self._searched)
                if j < 0:
                    self._searched = max(len(self._pending) - len(close) + 1, 0)
                    self._stream_block(self._pending)
                    break
                out.append(self._block(self._pending[:j], closed=True))
                self._pending = self._pending[j + (len(close) if self.fmt.close else 0):]
                self._in_block = False
        return "".join(out)

    def _auto_end(self) -> str:
        """At finish: an unclosed block may still be a call; any held text is content."""
        text, self._pending = self._pending, ""
        if self._in_block:
            self._in_block = False
            return self._block(text, closed=False)
        return text

    def _stream_block(self, body: str) -> None:
        """Hand out what an open block's call(s) already show (not a tail that may be the
        start of the marker ending the block)."""
        body = body[: len(body) - _marker_prefix_len(body, (self.fmt.close or self.fmt.open,))]
        if self._array is None and self._streamed is None and self.fmt.arrays \
                and body.lstrip().startswith("["):
            self._array = _ArrayScanner(self._log)
        if self._array is not None:
            self._array.feed(body[self._array_fed:])
            self._array_fed = len(body)
        elif self.fmt.partial is not None:
            self._stream(self.fmt.partial(body, self._functions, False))

    def _stream(self, call: tuple[str, str] | None) -> None:
        """Start the call once its name is known; send the arguments not yet sent."""
        if call is None:
            return
        name, arguments = call
        if self._streamed is None:
            self._streamed = self._log.start(name)
        if arguments.startswith(self._sent):  # else the text was rewritten: keep what was sent
            self._log.add(self._streamed, arguments[len(self._sent):])
            self._sent = arguments

    def _end_stream(self) -> None:
        self._streamed, self._sent = None, ""
        self._array, self._array_fed = None, 0

    def _block(self, body: str, closed: bool) -> str:
        """Log the block's call(s) and return "", or return the block's original text as
        content."""
        if self._array is not None:
            self._array.feed(body[self._array_fed:])
            self._end_stream()
            return ""
        if self._streamed is not None:
            assert self.fmt.partial is not None
            self._stream(self.fmt.partial(body, self._functions, True))
            self._end_stream()
            return ""
        calls = self.fmt.parse(body, self._functions)
        if calls:
            for call in calls:
                self._log.start(*call)
            return ""
        return self.fmt.open + body + (self.fmt.close if closed and self.fmt.close else "")
