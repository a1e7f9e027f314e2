"""How a model family writes a tool call into its text (`--tool-call-parser NAME`, named in
registry.py): a `CallFormat` says where a call starts and ends, and how its body names the
function and gives the arguments. Each family is a file of its own (hermes.py, qwen3_xml.py,
deepseek.py, mistral.py); the JSON helpers they share are here.

`parse` gets a call's body and the request's functions by name, and returns its calls as (name,
arguments as JSON text), or None when the body is not a call (it then stays content). A body is
read once it is whole; `checked` then keeps only calls the request can take (parser.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Functions = dict[str, dict[str, Any]]  # name -> the tool's function ({"name", "parameters"})
Call = tuple[str, str]  # (name, arguments JSON text)


@dataclass(frozen=True)
class CallFormat:
    open: str
    close: str | None  # None: a call ends where the next opens, or with the output
    parse: Callable[[str, Functions], list[Call] | None]
    drop: tuple[str, ...] = ()  # markers around a run of calls: removed from the content
    special_markers: bool = False  # its markers are special tokens: keep them in the text


def loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def compact(args: Any) -> str:
    return json.dumps(args, ensure_ascii=False, separators=(",", ":"))


def checked(calls: list[Call] | None, functions: Functions) -> list[Call] | None:
    """`calls` when each names a declared function and its arguments are a JSON object; None
    otherwise (the text they came from is then content: a client that gets a call to a
    function it did not declare, or arguments that do not parse, can do nothing with it)."""
    if not calls:
        return None
    for name, arguments in calls:
        if name not in functions or not isinstance(loads(arguments), dict):
            return None
    return calls


def json_call(body: str, functions: Functions | None = None) -> tuple[str, str] | None:
    """`{"name": ..., "arguments"|"parameters": ...}`; with `functions`, only a known name."""
    obj = loads(body.strip())
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if functions is not None and obj["name"] not in functions:
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):
        return obj["name"], args  # already JSON text, as OpenAI sends it
    if not isinstance(args, dict):
        return None
    return obj["name"], compact(args)


_FENCE = re.compile(r"^```(?:json)?\s*\n?(.*?)\n?```\s*$", re.S)


def json_arguments(text: str) -> str | None:
    """The arguments object, bare or in a ```json fence, as compact JSON text."""
    text = text.strip()
    fenced = _FENCE.match(text)
    args = loads(fenced[1] if fenced else text)
    return compact(args) if isinstance(args, dict) else None
