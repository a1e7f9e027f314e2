"""How each model family writes a tool call into its text (`--tool-call-parser NAME`): where a
call starts and ends, and how its body names the function and gives the arguments.

- `hermes` (Qwen2.5, Hermes, SmolLM...; the default) and `llama3_json`:
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Llama 3 writes the bare JSON,
  which the parser also takes when it is the whole answer).
- `qwen3_xml` / `qwen3_coder`: `<tool_call><function=NAME><parameter=KEY>value</parameter>
  </function></tool_call>`; values are read by the type the tool's schema gives them.
- `deepseek_v3`: `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` then the arguments in a
  ```json fence, `<｜tool▁call▁end｜>`; a run of calls sits between `<｜tool▁calls▁begin｜>` and
  `<｜tool▁calls▁end｜>`, which are neither content nor call.
- `deepseek_v31` (V3.1, V4): `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`.

`parse` gets a call's body and the request's functions by name, and returns (name, arguments as
compact JSON text), or None when the body is not a call (it then stays content).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Functions = dict[str, dict[str, Any]]  # name -> the tool's function ({"name", "parameters"})


@dataclass(frozen=True)
class CallFormat:
    open: str
    close: str
    parse: Callable[[str, Functions], tuple[str, str] | None]
    drop: tuple[str, ...] = ()  # markers around a run of calls: removed from the content


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


def _hermes(body: str, functions: Functions) -> tuple[str, str] | None:
    return json_call(body)


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def _qwen3_xml(body: str, functions: Functions) -> tuple[str, str] | None:
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
    return name, compact(args)


DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
DS_SEP = "<｜tool▁sep｜>"
_FENCE = re.compile(r"^```(?:json)?\s*\n?(.*?)\n?```\s*$", re.S)


def _arguments(text: str) -> str | None:
    text = text.strip()
    fenced = _FENCE.match(text)
    args = loads(fenced[1] if fenced else text)
    return compact(args) if isinstance(args, dict) else None


def _deepseek_v3(body: str, functions: Functions) -> tuple[str, str] | None:
    kind, sep, rest = body.partition(DS_SEP)
    name, _, text = rest.partition("\n")
    args = _arguments(text) if sep and kind.strip() == "function" else None
    return (name.strip(), args) if args is not None and name.strip() else None


def _deepseek_v31(body: str, functions: Functions) -> tuple[str, str] | None:
    name, sep, text = body.partition(DS_SEP)
    args = _arguments(text) if sep else None
    return (name.strip(), args) if args is not None and name.strip() else None


HERMES = CallFormat("<tool_call>", "</tool_call>", _hermes)
_QWEN3_XML = CallFormat("<tool_call>", "</tool_call>", _qwen3_xml)
_DS_DROP = (DS_CALLS_BEGIN, DS_CALLS_END)

def format_for_template(template: str | None) -> str:
    """The tool-call parser a chat template implies: the format it writes earlier calls back
    in; hermes when it shows none it knows."""
    template = template or ""
    if DS_CALLS_BEGIN in template:  # V3 fences the arguments, V3.1 and V4 do not
        return "deepseek_v3" if "```json" in template else "deepseek_v31"
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_xml"
    return "hermes"


TOOL_CALL_PARSERS: dict[str, CallFormat] = {
    "hermes": HERMES,
    "llama3_json": HERMES,
    "qwen3_xml": _QWEN3_XML,
    "qwen3_coder": _QWEN3_XML,
    "deepseek_v3": CallFormat(DS_CALL_BEGIN, DS_CALL_END, _deepseek_v3, _DS_DROP),
    "deepseek_v31": CallFormat(DS_CALL_BEGIN, DS_CALL_END, _deepseek_v31, _DS_DROP),
}
