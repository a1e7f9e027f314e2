"""`hermes` (Qwen2.5, Hermes, SmolLM...; the default) and `llama3_json`:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Llama 3 writes the bare JSON, which
the parser also takes when it is the whole answer)."""

from __future__ import annotations

from deepinfer.frontend.server.parsers.tool_calls.call_format import (
    Call,
    CallFormat,
    Functions,
    json_call,
)


def _one(call: Call | None) -> list[Call] | None:
    return None if call is None else [call]


def _hermes(body: str, functions: Functions) -> list[Call] | None:
    return _one(json_call(body))


HERMES = CallFormat("<tool_call>", "</tool_call>", _hermes)
