"""Reading the model's output for tool calls: `ToolCallParser` turns the generated text, fed as it
arrives, into message content and tool calls; non-streaming responses feed everything, then
`finish()`, and read `content` / `calls`, so both paths share one parser.

How the output is read depends on the mode (tools.py's `ToolSetup`):
- "none": everything is content.
- "named": the grammar forced the output to be the named function's arguments.
- "required": the grammar forced a JSON array `[{"name": ..., "arguments": {...}}, ...]`.
- "auto": free text with calls in the family's format (call_format.py; Hermes-style
  `<tool_call>{...}</tool_call>` by default), or a bare JSON call. A call in a block streams as
  it arrives: its name once known, then its arguments as the model writes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.frontend.server.parsers.tool_calls.array_scanner import ArrayScanner
from deepinfer.frontend.server.parsers.tool_calls.call_format import CallFormat, json_call
from deepinfer.frontend.server.parsers.tool_calls.call_log import CallLog, ToolCall, ToolCallDelta
from deepinfer.frontend.server.parsers.tool_calls.hermes import HERMES
from deepinfer.frontend.server.parsers.tool_calls.tools import ToolSetup


@dataclass
class ParsedDelta:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def merge(self, later: ParsedDelta) -> ParsedDelta:
        """This delta followed by `later`, as one."""
        return ParsedDelta(self.content + later.content, self.calls + later.calls)


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
        self._content: list[str] = []
        self._finished = False
        self._scanner = ArrayScanner(self._log) if self.mode == "required" else None
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
        self._array: ArrayScanner | None = None  # a block that is a JSON array of calls
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
            self._array = ArrayScanner(self._log)
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
