"""Streaming a JSON array of calls, `[{"name": "f", "arguments": {...}}, ...]`, call by call
as its characters arrive: what a grammar forces for tool_choice "required", and what some
families write in a block (call_format.py's `arrays`)."""

from __future__ import annotations

from deepinfer.frontend.server.parsers.tool_calls.call_format import loads
from deepinfer.frontend.server.parsers.tool_calls.call_log import CallLog


class ArrayScanner:
    """Character-level reader of `[{"name": "f", "arguments": {...}}, ...]` as it streams.

    Tracks bracket depth and string/escape state; depth 2 is inside an item object, where it
    follows `"key": value` pairs. A call starts once its "name" string is complete; the raw text of
    "arguments" is streamed (held back until the name is known if it comes first).
    """

    def __init__(self, log: CallLog) -> None:
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

