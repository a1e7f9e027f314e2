"""Scheduler statistics declared once (engine/statistics.py): every declaration with a metric
name is in /metrics with its value, and the progress log line comes from the log labels."""

from __future__ import annotations

from deepinfer.engine.protocol import PHASE_METRIC, SchedulerStats
from deepinfer.engine.statistics import (
    COUNTER,
    GAUGE,
    PER_POSITION,
    PHASE,
    declared_stats,
    progress_line,
)
from deepinfer.frontend.server.metrics import Metrics


class _Client:
    def __init__(self, stats: SchedulerStats) -> None:
        self.stats = stats


class _State:
    def __init__(self, stats: SchedulerStats) -> None:
        self.client, self.healthy = _Client(stats), True
        self.lora_adapters: dict[str, str] = {}


def _distinct_stats() -> SchedulerStats:
    """Every statistic a different value (lists: two positions)."""
    values = {}
    for i, name in enumerate(declared_stats(SchedulerStats), start=1):
        kind = declared_stats(SchedulerStats)[name]["kind"]
        values[name] = [i, i + 1000] if kind == PER_POSITION else i * 3
    return SchedulerStats(**values)


def test_every_declared_metric_is_exported_with_its_value():
    stats = _distinct_stats()
    body = Metrics(_State(stats)).render()[0].decode()
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in body.splitlines() if line.startswith("deepinfer_")}
    exported = 0
    for name, decl in declared_stats(SchedulerStats).items():
        metric, value = decl["metric"], getattr(stats, name)
        if metric is None:
            continue
        exported += 1
        if decl["kind"] == GAUGE:
            assert samples[metric] == value
        elif decl["kind"] == COUNTER:
            assert samples[f"{metric}_total"] == value
        elif decl["kind"] == PHASE:
            phase = name.removesuffix("_seconds")
            assert metric == PHASE_METRIC
            assert samples[f'{metric}_total{{phase="{phase}"}}'] == value
        else:
            for position, count in enumerate(value):
                assert samples[f'{metric}_total{{position="{position}"}}'] == count
    assert exported >= 25


def test_the_progress_line_reports_rates_gauges_and_step_phases():
    old = SchedulerStats(num_steps=10, generation_tokens_total=100, forward_seconds=1.0)
    new = SchedulerStats(num_steps=30, generation_tokens_total=300, prompt_tokens_total=50,
                         forward_seconds=1.5, num_running=4, kv_blocks_free=9,
                         kv_blocks_total=12)
    line = progress_line(old, new, 10.0)
    assert "20.0 gen tok/s" in line and "5.0 prompt tok/s" in line
    assert "running 4" in line and "free 9" in line and "KV blocks 12" in line
    assert "forward 25.00" in line  # 0.5 s over 20 steps
