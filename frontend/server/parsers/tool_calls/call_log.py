"""What a parser hands out about tool calls: a `ToolCallDelta` as a call streams, a whole
`ToolCall` at the end, and the `CallLog` of one output that gives both."""

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

