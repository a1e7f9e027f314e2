"""`qwen3_xml` / `qwen3_coder`: `<tool_call><function=NAME><parameter=KEY>value</parameter>
</function></tool_call>`; values are read by the type the tool's schema gives them."""

from __future__ import annotations

import re
from typing import Any

from deepinfer.frontend.server.parsers.tool_calls.call_format import (
    Call,
    CallFormat,
    Functions,
    compact,
    loads,
)

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def _qwen3_args(body: str, functions: Functions) -> tuple[str, dict[str, Any]] | None:
    """The function and its complete parameters so far."""
    match = _FUNCTION.search(body)
    if match is None:
        return None
    name = match[1].strip()
    schema = (functions.get(name) or {}).get("parameters") or {}
    properties = schema.get("properties") or {}
    args = {}
    for key, raw in _PARAMETER.findall(match[2]):
        kind = (properties.get(key) or {}).get("type")
        value = loads(raw)  # a number, a boolean, an object... unless the schema says string
        text = kind == "string" or (value is None and raw.strip() != "null")
        args[key] = raw if text else value
    return name, args


def _qwen3_xml(body: str, functions: Functions) -> list[Call] | None:
    found = _qwen3_args(body, functions)
    return None if found is None else [(found[0], compact(found[1]))]


QWEN3_XML = CallFormat("<tool_call>", "</tool_call>", _qwen3_xml)
