"""Scheduler statistics declared once: a field of SchedulerStats (engine/protocol.py) annotated
with `stat(...)` reaches `/metrics` (frontend/server/metrics.py renders every declaration) and
the scheduler's progress log line (`progress_line`) from that one declaration."""

from __future__ import annotations

import functools
import typing
from typing import Annotated, Any

import msgspec

__all__ = ["Annotated", "stat", "declared_stats", "progress_line", "GAUGE", "COUNTER", "PHASE",
           "PER_POSITION"]

# How a statistic is exported: a gauge (a value now), a counter (a running total), a phase
# (seconds of one step phase: one label of deepinfer_step_phase_seconds), or per position (a
# list: one label per draft position).
GAUGE, COUNTER, PHASE, PER_POSITION = "gauge", "counter", "phase", "per_position"


def stat(help: str, kind: str, metric: str | None = None, *,
         log: str | None = None) -> msgspec.Meta:
    """A statistic's help, kind, its /metrics name (None: logs and tests only) and its label in
    the progress line (None: not logged; a counter logs as a rate, a phase as ms a step)."""
    return msgspec.Meta(description=help,
                        extra={"kind": kind, "metric": metric, "log": log})


@functools.cache
def declared_stats(cls: type) -> dict[str, dict[str, Any]]:
    """Each declared statistic of `cls` by field name: help, kind, metric and log label."""
    out = {}
    for name, hint in typing.get_type_hints(cls, include_extras=True).items():
        if typing.get_origin(hint) is Annotated:
            for meta in typing.get_args(hint)[1:]:
                if isinstance(meta, msgspec.Meta) and meta.extra:
                    out[name] = {"help": meta.description, **meta.extra}
    return out


def progress_line(old: msgspec.Struct, new: msgspec.Struct, seconds: float) -> str:
    """The logged statistics between two snapshots `seconds` apart: counters as rates, gauges
    as they are now, phases as milliseconds a step."""
    steps = max(1, new.num_steps - old.num_steps)
    parts = {GAUGE: [], COUNTER: [], PHASE: []}
    for name, decl in declared_stats(type(new)).items():
        if decl["log"] is None:
            continue
        value, before = getattr(new, name), getattr(old, name)
        if decl["kind"] == COUNTER:
            parts[COUNTER].append(f"{(value - before) / max(seconds, 1e-9):.1f} {decl['log']}")
        elif decl["kind"] == PHASE:
            parts[PHASE].append(f"{decl['log']} {(value - before) * 1e3 / steps:.2f}")
        else:
            parts[GAUGE].append(f"{decl['log']} {value}")
    return " | ".join([", ".join(parts[COUNTER]), " ".join(parts[GAUGE]),
                       "per step ms: " + " ".join(parts[PHASE])])
