"""What a parser hands out about tool calls: a `ToolCallDelta` as a call goes out on a stream, a
whole `ToolCall` at the end, and the `CallLog` of one output that gives both.

A call goes out only once it is known to be one (a declared function, arguments that are a JSON
object): its first and only delta carries all of it, so a client never holds a call that later
turns out to be text, or arguments that do not parse."""

from __future__ import annotations

import uuid
from dataclasses import dataclass


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


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class CallLog:
    """The calls of one output, in order."""

    def __init__(self) -> None:
        self._calls: list[ToolCall] = []

    def add(self, name: str, arguments: str) -> ToolCallDelta:
        """Log a checked call; its delta (the whole call) for the stream."""
        call = ToolCall(_call_id(), name, arguments)
        self._calls.append(call)
        return ToolCallDelta(len(self._calls) - 1, call.id, name, arguments)

    def calls(self) -> list[ToolCall]:
        return list(self._calls)
