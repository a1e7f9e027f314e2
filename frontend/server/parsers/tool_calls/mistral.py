"""`mistral`: `[TOOL_CALLS]` then either a JSON array of `{"name", "arguments"}` (up to v0.3
tokenizers) or `NAME[ARGS]{...}` (v11+, one `[TOOL_CALLS]` per call); a call runs to the next
`[TOOL_CALLS]` or to the end of the output. `[TOOL_CALLS]` is a special token: the parser asks
for special tokens to be kept in the text."""

from __future__ import annotations

import re

from deepinfer.frontend.server.parsers.tool_calls.call_format import (
    Call,
    CallFormat,
    Functions,
    compact,
    json_arguments,
    json_call,
    loads,
)

MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
_MISTRAL_HEAD = re.compile(r"\s*(?P<name>[a-zA-Z0-9_-]{1,64})(?:\[CALL_ID\][^\[]*)?\[ARGS\]")


def _mistral(body: str, functions: Functions) -> list[Call] | None:
    items = loads(body.strip()) if body.lstrip().startswith("[") else None
    if isinstance(items, list):
        calls = [json_call(compact(item)) if isinstance(item, dict) else None for item in items]
        return None if not calls or None in calls else calls  # type: ignore[return-value]
    match = _MISTRAL_HEAD.match(body)
    args = json_arguments(body[match.end():]) if match else None
    return None if match is None or args is None else [(match["name"], args)]


MISTRAL = CallFormat(MISTRAL_CALLS, None, _mistral, special_markers=True)
