"""How a model family writes a tool call into its text (`--tool-call-parser NAME`, named in
registry.py): a `CallFormat` says where a call starts and ends, and how its body names the
function and gives the arguments. Each family is a file of its own (hermes.py, qwen3_xml.py,
deepseek.py, mistral.py); the JSON helpers they share are here.

`parse` gets a call's body and the request's functions by name, and returns its calls as (name,
arguments as compact JSON text), or None when the body is not a call (it then stays content).
`partial` reads a body still arriving: (name, the arguments text so far) once the name is known,
so that arguments stream as the model writes them; a closed body gives the whole arguments.
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
    partial: Callable[[str, Functions, bool], Call | None] | None = None
    drop: tuple[str, ...] = ()  # markers around a run of calls: removed from the content
    arrays: bool = False  # a body may be a JSON array of calls (streamed by the array scanner)
    special_markers: bool = False  # its markers are special tokens: keep them in the text


def loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def compact(args: Any) -> str:
    return json.dumps(args, ensure_ascii=False, separators=(",", ":"))


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


def json_object_prefix(text: str) -> str | None:
    """The JSON object `text` starts with (after whitespace), as far as it has arrived: up to its
    closing brace once complete. None when `text` does not start an object."""
    text = text.lstrip()
    if not text.startswith("{"):
        return None
    depth, in_string, escape = 0, False, False
    for i, c in enumerate(text):
        if in_string:
            if escape:
                escape = False
            elif c == "\\":
                escape = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return text[: i + 1]
    return text


def partial_after(head: re.Pattern[str]) -> Callable[[str, Functions, bool], Call | None]:
    """A `partial` for formats whose body is `head` (naming the function) then a JSON object."""
    def partial(body: str, functions: Functions, closed: bool) -> Call | None:
        match = head.match(body)
        if match is None or match["name"].strip() not in functions:
            return None
        args = json_object_prefix(body[match.end():])
        return None if args is None else (match["name"].strip(), args)
    return partial


_FENCE = re.compile(r"^```(?:json)?\s*\n?(.*?)\n?```\s*$", re.S)


def json_arguments(text: str) -> str | None:
    """The arguments object, bare or in a ```json fence, as compact JSON text."""
    text = text.strip()
    fenced = _FENCE.match(text)
    args = loads(fenced[1] if fenced else text)
    return compact(args) if isinstance(args, dict) else None
