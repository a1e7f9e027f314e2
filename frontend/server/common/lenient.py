"""Decoding a request body that carries fields this server does not declare.

Real clients (Claude Code, Codex, litellm) send every field their vendor's API accepts today,
and vendors add fields every month; refusing the unknown made every new client release fail on
its first request. As vLLM and llama.cpp do, a field no request struct declares is ignored, and
logged once per endpoint and field (a typo shows up in the log, not as a silently wrong answer
nobody can explain). What would change the answer is declared and refused by name where it is
checked (sampling.py, the translations), and a value of the wrong type is still a 400.

The structs stay strict (`forbid_unknown_fields`), so a clean body decodes in one pass; a body
with unknown fields decodes again without them: each failure names one field at one path, and
that field is dropped from every object its path pattern matches (`tools[3].x` drops `x` from
every tool), so a field repeated in many items costs one retry. After `MAX_DROPS` distinct
fields the 400 stands: a body made of thousands of invented fields is not worth the decodes.
"""

from __future__ import annotations

import logging
import re
from typing import Any, TypeVar

import msgspec

log = logging.getLogger("deepinfer.api")
T = TypeVar("T")

MAX_DROPS = 32
MAX_LOGGED = 1000
# msgspec's wording; a field of the top-level object has no " - at" part.
_UNKNOWN = re.compile(
    r"^Object contains unknown field `(?P<field>[^`]+)`( - at `\$(?P<at>[^`]*)`)?$")
_STEP = re.compile(r"\.(\w+)|\[(\d+)\]")
_logged: set[tuple[str, str]] = set()


def _path(at: str) -> list[str | None] | None:
    """`.tools[3].input` -> ["tools", None, "input"] (None: any list index); None if unparsable."""
    steps: list[str | None] = []
    pos = 0
    for m in _STEP.finditer(at):
        if m.start() != pos:
            return None
        steps.append(m.group(1))
        pos = m.end()
    return steps if pos == len(at) else None


def _drop(node: Any, steps: list[str | None], field: str) -> int:
    """Remove `field` from every object at `steps` under `node`; how many were removed."""
    if not steps:
        return int(isinstance(node, dict) and node.pop(field, _drop) is not _drop)
    step, rest = steps[0], steps[1:]
    if step is None:
        return sum(_drop(item, rest, field) for item in node) if isinstance(node, list) else 0
    return _drop(node.get(step), rest, field) if isinstance(node, dict) else 0


def _pattern(at: str, field: str) -> str:
    return (re.sub(r"\[\d+\]", "[]", at).lstrip(".") + "." + field).lstrip(".")


def _shown(name: str) -> str:
    """A client-chosen name as a log may show it: one short printable line."""
    name = name if name.isprintable() else ascii(name)
    return name if len(name) <= 80 else name[:80] + "..."


def warn_once(endpoint: str, what: str, message: str) -> None:
    """Log `message` the first time `endpoint` meets `what` (a field, a tool type). Names are
    the client's to choose: past MAX_LOGGED of them, new ones are no longer remembered (nor
    logged), so that invented names neither grow memory nor flood the log."""
    if (endpoint, what) in _logged or len(_logged) > MAX_LOGGED:
        return
    _logged.add((endpoint, what))
    if len(_logged) > MAX_LOGGED:
        message = "further fields and tool types this server does not serve are not logged"
    log.warning("%s: %s (logged once)", endpoint, message)


def _note(endpoint: str, pattern: str) -> None:
    warn_once(endpoint, pattern,
              f"ignoring the field {_shown(pattern)}, which this server does not serve")


def _without_unknown(obj: Any, exc: msgspec.ValidationError, endpoint: str) -> bool:
    """Drop the unknown field `exc` names from `obj`; False if `exc` is another error."""
    m = _UNKNOWN.match(str(exc))
    at = (m.group("at") or "") if m else ""
    steps = _path(at) if m else None
    if m is None or steps is None or not _drop(obj, steps, m.group("field")):
        return False
    _note(endpoint, _pattern(at, m.group("field")))
    return True


def _convert(obj: Any, type_: type[T], endpoint: str, drops: int) -> T:
    while True:
        try:
            return msgspec.convert(obj, type_)
        except msgspec.ValidationError as exc:
            if drops == 0 or not _without_unknown(obj, exc, endpoint):
                raise
            drops -= 1


def convert_lenient(obj: Any, type_: type[T], endpoint: str) -> T:
    """`msgspec.convert(obj, type_)`, ignoring (and logging once) fields `type_` does not
    declare; `obj` (decoded JSON) loses them. Other errors raise as msgspec raises them."""
    return _convert(obj, type_, endpoint, MAX_DROPS)


def decode_lenient(body: bytes, type_: type[T], endpoint: str) -> T:
    """`msgspec.json.decode(body, type=type_)`, ignoring fields `type_` does not declare."""
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        obj = msgspec.json.decode(body)
        if not _without_unknown(obj, exc, endpoint):
            raise
    return _convert(obj, type_, endpoint, MAX_DROPS - 1)
