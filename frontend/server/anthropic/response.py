"""The chat path's turns in the Anthropic Messages API's shapes: a whole message, or the events
of its stream.

A stream opens content blocks in the order the model writes them: each change of kind (thinking,
text, a tool call) closes the open block and opens the next, and each tool call is a block of
its own whose input arrives as `input_json_delta` fragments that concatenate to its JSON. A whole
message lists its blocks in the same order (the turn's `parts`).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from deepinfer.frontend.server.anthropic.schema import (
    MessageOut,
    MessageUsage,
    StopReason,
    TextOut,
    ThinkingOut,
    ToolUseOut,
)
from deepinfer.frontend.server.common.chat_turns import Turn, TurnDelta
from deepinfer.frontend.server.common.usage import Usage

Event = tuple[str, dict[str, Any]]  # (SSE event name, its data)

_STOP_REASONS: dict[str, StopReason] = {"length": "max_tokens", "tool_calls": "tool_use"}


def stop_reason(finish_reason: str | None, stop: str | None) -> StopReason | None:
    """Anthropic's stop_reason for OpenAI's finish_reason ("abort", "stop": end_turn)."""
    if finish_reason is None:
        return None
    if finish_reason == "stop" and stop is not None:
        return "stop_sequence"
    return _STOP_REASONS.get(finish_reason, "end_turn")


def _sequence(reason: StopReason | None, stop: str | None) -> str | None:
    return stop if reason == "stop_sequence" else None


def tool_use_id(call_id: str) -> str:
    """The call's id as Anthropic writes one (`toolu_...`); sent back, it is used as is."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """The call's arguments as the object `input` must be; {} when they are no JSON object
    (a call cut short by max_tokens, whose stop_reason says so)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def message_usage(usage: Usage) -> MessageUsage:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return MessageUsage(usage.prompt_tokens - cached, usage.completion_tokens, cached)


def message_body(rid: str, model: str, turn: Turn, usage: Usage) -> MessageOut:
    content: list[ThinkingOut | TextOut | ToolUseOut] = []
    if turn.reasoning:  # only a reasoning parser sets it
        content.append(ThinkingOut(turn.reasoning))
    content.extend(TextOut(p) if isinstance(p, str) else
                   ToolUseOut(tool_use_id(p.id), p.name, tool_input(p.arguments))
                   for p in turn.parts)
    reason = stop_reason(turn.finish_reason, turn.stop_reason)
    return MessageOut(id=rid, model=model, content=content, stop_reason=reason,
                      stop_sequence=_sequence(reason, turn.stop_reason),
                      usage=message_usage(usage))


class MessageEvents:
    """One streamed message's events: `start`, then `feed` each delta, then `finish`."""

    def __init__(self) -> None:
        self.index = -1  # the open block's index
        self.kind: str | None = None  # the open block's: "thinking", "text", "tool_use"
        self.final: TurnDelta | None = None

    def start(self, rid: str, model: str, usage: Usage) -> list[Event]:
        message = MessageOut(id=rid, model=model, content=[], stop_reason=None,
                             stop_sequence=None, usage=message_usage(usage))
        return [("message_start", {"type": "message_start",
                                   "message": msgspec.to_builtins(message)}),
                ("ping", {"type": "ping"})]

    def _open(self, kind: str, block: dict[str, Any]) -> list[Event]:
        events = self._close()
        self.index += 1
        self.kind = kind
        events.append(("content_block_start", {"type": "content_block_start",
                                               "index": self.index, "content_block": block}))
        return events

    def _close(self) -> list[Event]:
        if self.kind is None:
            return []
        self.kind = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict[str, Any]) -> Event:
        return ("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                        "delta": delta})

    def feed(self, d: TurnDelta) -> list[Event]:
        events: list[Event] = []
        if d.reasoning:
            if self.kind != "thinking":
                events += self._open("thinking", {"type": "thinking", "thinking": "",
                                                  "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": d.reasoning}))
        if d.content:
            if self.kind != "text":
                events += self._open("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": d.content}))
        for call in d.calls:
            if call.id is not None:  # a call's first delta: a block of its own
                events += self._open("tool_use", {"type": "tool_use", "id": tool_use_id(call.id),
                                                  "name": call.name or "", "input": {}})
            if call.arguments:
                events.append(self._delta({"type": "input_json_delta",
                                           "partial_json": call.arguments}))
        if d.finish_reason is not None:
            self.final = d
        return events

    def finish(self, usage: Usage) -> list[Event]:
        """Close the open block; the stop reason and the final usage; the end."""
        final = self.final or TurnDelta(0, finish_reason="stop")
        reason = stop_reason(final.finish_reason, final.stop_reason)
        return [*self._close(),
                ("message_delta", {"type": "message_delta", "delta": {
                    "stop_reason": reason, "stop_sequence": _sequence(reason, final.stop_reason)},
                    "usage": msgspec.to_builtins(message_usage(usage))}),
                ("message_stop", {"type": "message_stop"})]
