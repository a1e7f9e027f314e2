"""Reading the model's output for tool calls: `ToolCallParser` turns the generated text, fed as it
arrives, into message content and tool calls, in the order the model wrote them; non-streaming
responses feed everything, then `finish()`, and read `parts` (or `content` / `calls`), so both
paths share one parser and agree piece for piece.

A call goes out whole, once it is known to be one: a declared function whose arguments are a
JSON object (call_format.py's `checked`). Until then its text is held; text that turns out not
to be a call is content, tags included. So a stream never sends a call it would take back, nor
arguments that do not parse, and streamed and whole answers are the same.

How the output is read depends on the mode (tools.py's `ToolSetup`):
- "none": everything is content.
- "named": the grammar forced the output to be the named function's arguments (one call at the
  end; cut short, it is content).
- "required": the grammar forced a JSON array `[{"name": ..., "arguments": {...}}, ...]`: each
  call goes out as its item closes (cut short, the rest is content).
- "auto": free text with calls in the family's format (call_format.py; Hermes-style
  `<tool_call>{...}</tool_call>` by default), or a bare JSON call: a call in a block goes out
  when its block closes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.frontend.server.parsers.tool_calls.array_scanner import ArrayScanner
from deepinfer.frontend.server.parsers.tool_calls.call_format import (
    Call,
    CallFormat,
    checked,
    json_call,
)
from deepinfer.frontend.server.parsers.tool_calls.call_log import CallLog, ToolCall, ToolCallDelta
from deepinfer.frontend.server.parsers.tool_calls.hermes import HERMES
from deepinfer.frontend.server.parsers.tool_calls.tools import ToolSetup

Part = str | ToolCallDelta  # a piece of content, or a call


@dataclass
class ParsedDelta:
    parts: list[Part] = field(default_factory=list)  # in the order the model wrote them

    @property
    def content(self) -> str:
        return "".join(p for p in self.parts if isinstance(p, str))

    @property
    def calls(self) -> list[ToolCallDelta]:
        return [p for p in self.parts if not isinstance(p, str)]

    def merge(self, later: ParsedDelta) -> ParsedDelta:
        """This delta followed by `later`, as one."""
        return ParsedDelta(self.parts + later.parts)


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
        self._log = CallLog()
        self._parts: list[Part] = []  # everything handed out, in order
        self._out: list[Part] = []  # what the current feed hands out
        self._finished = False
        self._scanner = ArrayScanner() if self.mode == "required" else None
        # Text not yet decided: in auto mode, what may still begin a marker, an open block, or
        # a candidate bare-JSON call (held back entirely until finish); in named mode, all.
        self._pending = ""
        self._searched = 0
        self._in_block = False
        self._leading: str | None = ""  # output while only whitespace came; None once decided
        self._bare_json = False

    @property
    def parts(self) -> list[Part]:
        """Content and calls as handed out, in order (consecutive content not merged)."""
        return list(self._parts)

    @property
    def content(self) -> str:
        return "".join(p for p in self._parts if isinstance(p, str))

    @property
    def calls(self) -> list[ToolCall]:
        return self._log.calls()

    def feed(self, text: str) -> ParsedDelta:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if self.mode == "none":
            self._text(text)
        elif self.mode == "named":
            self._pending += text
        elif self.mode == "required":
            self._required(text)
        else:
            self._auto(text)
        return self._take()

    def finish(self) -> ParsedDelta:
        if self._finished:
            return ParsedDelta()
        self._finished = True
        if self.mode == "named":
            args = self._pending
            if not self._emit([(self._named or "", args)]):
                self._text(args)
        elif self.mode == "required":
            assert self._scanner is not None
            if not self._scanner.closed:  # cut short: what did not make a call is text
                self._text("".join(self._scanner.since))
        elif self.mode == "auto":
            self._auto_finish()
        return self._take()

    def _take(self) -> ParsedDelta:
        out, self._out = self._out, []
        self._parts.extend(out)
        return ParsedDelta(out)

    def _text(self, text: str) -> None:
        if text:
            self._out.append(text)

    def _emit(self, calls: list[Call] | None) -> bool:
        """Hand out `calls` if the request can take them all; False (nothing sent) if not."""
        calls = checked(calls, self._functions)
        if calls is None:
            return False
        self._out.extend(self._log.add(name, arguments) for name, arguments in calls)
        return True

    def _required(self, text: str) -> None:
        assert self._scanner is not None
        for item in self._scanner.feed(text):  # (the punctuation between items is no content)
            call = json_call(item, self._functions)
            if not self._emit(None if call is None else [call]):
                self._text(item)  # not a call (the grammar rules it out): say what it was

    def _auto(self, text: str) -> None:
        """Content that is settled after `text`, and the calls it completes, in order."""
        if self._leading is not None:
            self._leading += text
            if not self._leading.strip():
                return  # leading whitespace: hold until we see how the output starts
            text, self._leading = self._leading, None
            self._bare_json = text.lstrip().startswith("{")
        self._pending += text
        if self._bare_json:
            return  # held whole: text after the object would make it an answer, not a call
        while True:
            if not self._in_block:
                for marker in self.fmt.drop:  # (whole ones: a split one is held below)
                    self._pending = self._pending.replace(marker, "")
                i = self._pending.find(self.fmt.open)
                if i < 0:
                    keep = _marker_prefix_len(self._pending, (self.fmt.open, *self.fmt.drop))
                    self._text(self._pending[: len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep:]
                    return
                self._text(self._pending[:i])
                self._pending = self._pending[i + len(self.fmt.open):]
                self._in_block, self._searched = True, 0
            else:
                # search only where the close tag could newly appear: blocks may come char by char
                # (a format without one ends a call where the next opens, which stays pending)
                close = self.fmt.close or self.fmt.open
                j = self._pending.find(close, self._searched)
                if j < 0:
                    self._searched = max(len(self._pending) - len(close) + 1, 0)
                    return
                self._block(self._pending[:j], closed=True)
                self._pending = self._pending[j + (len(close) if self.fmt.close else 0):]
                self._in_block = False

    def _auto_finish(self) -> None:
        """The end of the output: an unclosed block may still be a call; any held text is
        content."""
        if self._leading is not None:  # only whitespace ever came
            self._text(self._leading)
            return
        if self._bare_json:
            if self._emit([c] if (c := json_call(self._pending, self._functions)) else None):
                return
            # not a call after all: read the held text as ordinary output
            text, self._pending, self._bare_json = self._pending, "", False
            self._auto(text)
        text, self._pending = self._pending, ""
        if self._in_block:
            self._in_block = False
            self._block(text, closed=False)
        else:
            self._text(text)

    def _block(self, body: str, closed: bool) -> None:
        """The block's call(s), or its original text as content."""
        if not self._emit(self.fmt.parse(body, self._functions)):
            self._text(self.fmt.open + body + (self.fmt.close if closed and self.fmt.close
                                               else ""))

