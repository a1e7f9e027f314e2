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
- `mistral`: `[TOOL_CALLS]` then either a JSON array of `{"name", "arguments"}` (up to v0.3
  tokenizers) or `NAME[ARGS]{...}` (v11+, one `[TOOL_CALLS]` per call); a call runs to the next
  `[TOOL_CALLS]` or to the end of the output. `[TOOL_CALLS]` is a special token: the parser
  asks for special tokens to be kept in the text.

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


def _partial_after(head: re.Pattern[str]) -> Callable[[str, Functions, bool], Call | None]:
    """A `partial` for formats whose body is `head` (naming the function) then a JSON object."""
    def partial(body: str, functions: Functions, closed: bool) -> Call | None:
        match = head.match(body)
        if match is None or match["name"].strip() not in functions:
            return None
        args = json_object_prefix(body[match.end():])
        return None if args is None else (match["name"].strip(), args)
    return partial


def _one(call: Call | None) -> list[Call] | None:
    return None if call is None else [call]


def _hermes(body: str, functions: Functions) -> list[Call] | None:
    return _one(json_call(body))


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


def _qwen3_partial(body: str, functions: Functions, closed: bool) -> Call | None:
    found = _qwen3_args(body, functions)
    if found is None or found[0] not in functions:
        return None
    args = compact(found[1])  # each parameter as it closes; the brace once the call does
    return found[0], args if closed else args[:-1]


DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
DS_SEP = "<｜tool▁sep｜>"
_FENCE = re.compile(r"^```(?:json)?\s*\n?(.*?)\n?```\s*$", re.S)


def _arguments(text: str) -> str | None:
    text = text.strip()
    fenced = _FENCE.match(text)
    args = loads(fenced[1] if fenced else text)
    return compact(args) if isinstance(args, dict) else None


def _deepseek_v3(body: str, functions: Functions) -> list[Call] | None:
    kind, sep, rest = body.partition(DS_SEP)
    name, _, text = rest.partition("\n")
    args = _arguments(text) if sep and kind.strip() == "function" else None
    return [(name.strip(), args)] if args is not None and name.strip() else None


def _deepseek_v31(body: str, functions: Functions) -> list[Call] | None:
    name, sep, text = body.partition(DS_SEP)
    args = _arguments(text) if sep else None
    return [(name.strip(), args)] if args is not None and name.strip() else None


MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
_MISTRAL_HEAD = re.compile(r"\s*(?P<name>[a-zA-Z0-9_-]{1,64})(?:\[CALL_ID\][^\[]*)?\[ARGS\]")


def _mistral(body: str, functions: Functions) -> list[Call] | None:
    items = loads(body.strip()) if body.lstrip().startswith("[") else None
    if isinstance(items, list):
        calls = [json_call(compact(item)) if isinstance(item, dict) else None for item in items]
        return None if not calls or None in calls else calls  # type: ignore[return-value]
    match = _MISTRAL_HEAD.match(body)
    args = _arguments(body[match.end():]) if match else None
    return None if match is None or args is None else [(match["name"], args)]


_JSON_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"(?P<name>[^"\\]*)"\s*,\s*'
                        r'"(?:arguments|parameters)"\s*:')
HERMES = CallFormat("<tool_call>", "</tool_call>", _hermes, _partial_after(_JSON_HEAD))
_QWEN3_XML = CallFormat("<tool_call>", "</tool_call>", _qwen3_xml, _qwen3_partial)
_DS_DROP = (DS_CALLS_BEGIN, DS_CALLS_END)
_DS_V3_HEAD = re.compile(rf"\s*function{re.escape(DS_SEP)}(?P<name>[^\n]+)\n```(?:json)?[ \t]*\n?")
_DS_V31_HEAD = re.compile(rf"\s*(?P<name>[^\n<]+?){re.escape(DS_SEP)}")

def format_for_template(template: str | None) -> str:
    """The tool-call parser a chat template implies: the format it writes earlier calls back
    in; hermes when it shows none it knows."""
    template = template or ""
    if DS_CALLS_BEGIN in template:  # V3 fences the arguments, V3.1 and V4 do not
        return "deepseek_v3" if "```json" in template else "deepseek_v31"
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_xml"
    if MISTRAL_CALLS in template:
        return "mistral"
    return "hermes"


TOOL_CALL_PARSERS: dict[str, CallFormat] = {
    "hermes": HERMES,
    "llama3_json": HERMES,
    "qwen3_xml": _QWEN3_XML,
    "qwen3_coder": _QWEN3_XML,
    "deepseek_v3": CallFormat(DS_CALL_BEGIN, DS_CALL_END, _deepseek_v3,
                              _partial_after(_DS_V3_HEAD), _DS_DROP),
    "deepseek_v31": CallFormat(DS_CALL_BEGIN, DS_CALL_END, _deepseek_v31,
                               _partial_after(_DS_V31_HEAD), _DS_DROP),
    "mistral": CallFormat(MISTRAL_CALLS, None, _mistral, _partial_after(_MISTRAL_HEAD),
                          arrays=True, special_markers=True),
}
