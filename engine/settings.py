"""Engine settings declared once: a field of EngineConfig (engine/config.py) annotated with
`setting(...)` is a flag of `deepinfer serve` / `generate` (--name-with-dashes, help, choices,
type: frontend/cli.py), a keyword argument of the offline `LLM`, and a value checked on every
construction of the config (`check_settings`), from that one declaration."""

from __future__ import annotations

import functools
import types
import typing
from typing import Annotated, Any

import msgspec

__all__ = ["Annotated", "setting", "settings", "check_settings", "flag"]


def setting(help: str, choices: tuple[str, ...] = (), *, at_least: float | None = None,
            positive: bool = False) -> msgspec.Meta:
    """A setting's help text and the values it takes (None is always accepted: unset)."""
    return msgspec.Meta(description=help, extra={"choices": choices, "at_least": at_least,
                                                 "positive": positive})


def flag(name: str) -> str:
    """The command-line flag of a setting."""
    return "--" + name.replace("_", "-")


@functools.cache
def settings(cls: type) -> dict[str, tuple[type, msgspec.Meta]]:
    """Each declared setting of `cls` by field name: its value type (bool, int, float, str or
    list[str]: a flag taking several values; None stripped) and its declaration."""
    out = {}
    for name, hint in typing.get_type_hints(cls, include_extras=True).items():
        if typing.get_origin(hint) is not Annotated:
            continue
        kind, *metas = typing.get_args(hint)
        decl = next((m for m in metas if isinstance(m, msgspec.Meta) and m.extra), None)
        if decl is None:
            continue
        if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
            kind = next(k for k in typing.get_args(kind) if k is not type(None))
        out[name] = (kind, decl)
    return out


def check_settings(obj: Any, error: type[Exception]) -> None:
    """Raise `error`, naming the flag, for a value its declaration refuses."""
    for name, (_, decl) in settings(type(obj)).items():
        value = getattr(obj, name)
        if value is None or isinstance(value, (bool, list)):
            continue
        rule = decl.extra
        if rule["choices"] and value not in rule["choices"]:
            raise error(f"{flag(name)} must be one of {', '.join(rule['choices'])}, "
                        f"not {value!r}")
        if rule["at_least"] is not None and value < rule["at_least"]:
            raise error(f"{flag(name)} must be at least {rule['at_least']:g}, got {value:g}")
        if rule["positive"] and value <= 0:
            raise error(f"{flag(name)} must be positive, got {value:g}")
