"""DeepSeek's tool calls, in two formats:

- `deepseek_v3`: `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` then the arguments in a
  ```json fence, `<｜tool▁call▁end｜>`; a run of calls sits between `<｜tool▁calls▁begin｜>` and
  `<｜tool▁calls▁end｜>`, which are neither content nor call.
- `deepseek_v31` (V3.1, V4): `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`.
"""

from __future__ import annotations

from deepinfer.frontend.server.parsers.tool_calls.call_format import (
    Call,
    CallFormat,
    Functions,
    json_arguments,
)

DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
DS_SEP = "<｜tool▁sep｜>"


def _deepseek_v3(body: str, functions: Functions) -> list[Call] | None:
    kind, sep, rest = body.partition(DS_SEP)
    name, _, text = rest.partition("\n")
    args = json_arguments(text) if sep and kind.strip() == "function" else None
    return [(name.strip(), args)] if args is not None and name.strip() else None


def _deepseek_v31(body: str, functions: Functions) -> list[Call] | None:
    name, sep, text = body.partition(DS_SEP)
    args = json_arguments(text) if sep else None
    return [(name.strip(), args)] if args is not None and name.strip() else None


_DS_DROP = (DS_CALLS_BEGIN, DS_CALLS_END)
DEEPSEEK_V3 = CallFormat(DS_CALL_BEGIN, DS_CALL_END, _deepseek_v3, _DS_DROP)
DEEPSEEK_V31 = CallFormat(DS_CALL_BEGIN, DS_CALL_END, _deepseek_v31, _DS_DROP)
