"""Prometheus metrics of the API server, plus the engine's latest statistics (each declared
once in engine/protocol.py's SchedulerStats).

Each server has its own registry (tests run several apps in one process). The metrics read the
server's state at scrape time through `ScrapedState`, the little they need of it, so that this
module stays below state.py, which builds the metrics.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from deepinfer.engine.protocol import KV_TRANSFER_BUCKETS, SchedulerStats
from deepinfer.engine.statistics import GAUGE, PER_POSITION, PHASE, declared_stats

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
)


class _StatsSource(Protocol):
    @property
    def stats(self) -> SchedulerStats: ...


class ScrapedState(Protocol):
    """What the metrics read of the server's state (state.py's ServerState is one)."""

    @property
    def client(self) -> _StatsSource | None: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def lora_adapters(self) -> dict[str, str]: ...


class EngineStatsCollector(Collector):
    """Reads the scheduler's latest SchedulerStats at scrape time."""

    def __init__(self, state: ScrapedState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        client = self.state.client
        healthy = GaugeMetricFamily("deepinfer_engine_healthy", "1 when the engine is up")
        healthy.add_metric([], 1.0 if self.state.healthy else 0.0)
        yield healthy
        if client is None:
            return
        s = client.stats
        yield from _declared_metrics(s)
        # Derived from the declared statistics.
        for name, doc, value in (
                ("deepinfer_kv_blocks_used", "KV cache blocks in use",
                 s.kv_blocks_total - s.kv_blocks_free),
                ("deepinfer_prefix_cache_hit_rate",
                 "prompt tokens found in the prefix cache / looked up",
                 s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0),
                ("deepinfer_spec_decode_acceptance_rate",
                 "accepted / verified draft tokens (0 before any draft)",
                 s.spec_accepted_tokens / s.spec_draft_tokens if s.spec_draft_tokens else 0.0)):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            yield g
        yield _histogram("deepinfer_kv_transfer_seconds", "seconds per KV transfer",
                         s.kv_transfer_buckets, s.kv_transfer_seconds)
        yield from _tier_metrics(s)
        # The exactness audit (--audit-rate): a cold re-run that differed, once per shortcut
        # the original took ("none": it took none).
        family = CounterMetricFamily("deepinfer_audit_divergences",
                                     "finished requests whose cold re-run differed, by the "
                                     "shortcut the original took", labels=["shortcut"])
        # "none" always: the series (and its label) exists before the first divergence.
        for shortcut, count in sorted({"none": 0, **s.audit_divergences}.items()):
            family.add_metric([shortcut], float(count))
        yield family


def _declared_metrics(s: SchedulerStats) -> Iterator[Metric]:
    """Every statistic SchedulerStats declares with a metric name (engine/protocol.py). A
    counter renders as NAME_total; the phases are labels of one counter."""
    phases = None
    for name, decl in declared_stats(type(s)).items():
        metric, kind, value = decl["metric"], decl["kind"], getattr(s, name)
        if metric is None:
            continue
        if kind == PHASE:
            if phases is None:
                phases = CounterMetricFamily(metric, "cumulative seconds per step phase",
                                             labels=["phase"])
            phases.add_metric([name.removesuffix("_seconds")], float(value))
        elif kind == PER_POSITION:
            family = CounterMetricFamily(metric, decl["help"], labels=["position"])
            for position, count in enumerate(value):
                family.add_metric([str(position)], float(count))
            yield family
        else:
            family = (GaugeMetricFamily if kind == GAUGE else CounterMetricFamily)(
                metric, decl["help"])
            family.add_metric([], float(value))
            yield family
    if phases is not None:
        yield phases


def _histogram(name: str, doc: str, buckets: list[int], total: float,
               labels: dict[str, str] | None = None) -> Metric:
    """A histogram from counts per bucket of KV_TRANSFER_BUCKETS (the scheduler's stats)."""
    counts = buckets or [0] * (len(KV_TRANSFER_BUCKETS) + 1)
    cumulative, n = [], 0
    for bound, count in zip((*map(str, KV_TRANSFER_BUCKETS), "+Inf"), counts):
        n += count
        cumulative.append((bound, float(n)))
    labels = labels or {}
    h = HistogramMetricFamily(name, doc, labels=list(labels))
    h.add_metric(list(labels.values()), cumulative, sum_value=total)
    return h


def _tier_metrics(s: SchedulerStats) -> Iterator[Metric]:
    """The KV cache's tiers side by side: device (the prefix cache), host, disk."""
    host, disk = s.host_hit_tokens, s.disk_hit_tokens
    for name, doc, values in (
            ("deepinfer_kv_tier_hit_tokens", "prompt tokens served from each tier of the KV cache",
             {"device": s.prefix_cache_hits - host - disk, "host": host, "disk": disk}),
            ("deepinfer_kv_tier_read_bytes", "bytes read back from each tier",
             {"host": s.host_blocks_in * s.host_block_bytes, "disk": s.disk_bytes_read}),
            ("deepinfer_kv_tier_written_bytes", "bytes written to each tier",
             {"host": s.host_blocks_out * s.host_block_bytes, "disk": s.disk_bytes_written})):
        family = CounterMetricFamily(name, doc, labels=["tier"])
        for tier, value in values.items():
            family.add_metric([tier], float(value))
        yield family
    yield _histogram("deepinfer_kv_tier_read_seconds", "seconds per read of a request's blocks",
                     s.disk_read_buckets, s.disk_read_seconds, {"tier": "disk"})
    yield _histogram("deepinfer_kv_tier_write_seconds", "seconds per block written",
                     s.disk_write_buckets, s.disk_write_seconds, {"tier": "disk"})


class Metrics:
    def __init__(self, state: ScrapedState) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "deepinfer_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
            registry=r,
        )
        self.in_flight = Gauge(
            "deepinfer_requests_in_flight", "engine requests admitted and not finished",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "deepinfer_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(
            "deepinfer_generation_tokens", "generated tokens of finished requests", registry=r)
        self.ttft = Histogram(
            "deepinfer_time_to_first_token_seconds", "time to the first generated token",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.replayed = Histogram(
            "deepinfer_swa_replayed_tokens_per_request",
            "tokens a request recomputed to rebuild sliding windows after a prefix hit",
            buckets=(0, 16, 64, 256, 1024, 4096, 16384), registry=r,
        )
        self.slow_readers = Counter(
            "deepinfer_slow_reader_aborts", "streams aborted because their client read too "
            "slowly (--max-buffered-outputs)", registry=r)
        self.e2e = Histogram(
            "deepinfer_e2e_request_latency_seconds", "request latency, arrival to last token",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        # Per LoRA adapter, by its name (the base model's requests are counted above only).
        self.lora_requests = Counter(
            "deepinfer_lora_requests", "finished requests per LoRA adapter", ["adapter"],
            registry=r)
        self.lora_prompt_tokens = Counter(
            "deepinfer_lora_prompt_tokens", "prompt tokens of finished requests per LoRA adapter",
            ["adapter"], registry=r)
        self.lora_generation_tokens = Counter(
            "deepinfer_lora_generation_tokens",
            "generated tokens of finished requests per LoRA adapter", ["adapter"], registry=r)
        self.lora_load_seconds = Histogram(
            "deepinfer_lora_load_seconds",
            "seconds a worker took to read, check and attach a LoRA adapter",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=r)
        adapters = Gauge("deepinfer_lora_adapters_loaded", "LoRA adapters this server serves",
                         registry=r)
        adapters.set_function(lambda: len(state.lora_adapters))
        r.register(EngineStatsCollector(state))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
