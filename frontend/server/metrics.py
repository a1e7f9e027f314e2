"""Prometheus metrics of the API server, plus gauges read from the engine's latest stats.

Each server has its own registry (tests run several apps in one process).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

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

from deepinfer.engine.protocol import KV_TRANSFER_BUCKETS

if TYPE_CHECKING:
    from deepinfer.engine.protocol import SchedulerStats
    from deepinfer.frontend.server.state import ServerState

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
)


class EngineStatsCollector(Collector):
    """Reads the scheduler's latest SchedulerStats at scrape time."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        client = self.state.client
        healthy = GaugeMetricFamily("deepinfer_engine_healthy", "1 when the engine is up")
        healthy.add_metric([], 1.0 if self.state.healthy else 0.0)
        yield healthy
        if client is None:
            return
        s = client.stats
        gauges = {
            "deepinfer_kv_blocks_total": ("KV cache blocks in total", s.kv_blocks_total),
            "deepinfer_kv_blocks_free": ("KV cache blocks free", s.kv_blocks_free),
            "deepinfer_kv_blocks_used": (
                "KV cache blocks in use", s.kv_blocks_total - s.kv_blocks_free),
            "deepinfer_num_requests_running": ("requests being computed", s.num_running),
            "deepinfer_num_requests_waiting": ("requests waiting for a slot", s.num_waiting),
            "deepinfer_kv_blocks_cached": ("blocks held by the prefix cache", s.kv_blocks_cached),
            "deepinfer_prefix_cache_hit_rate": (
                "prompt tokens found in the prefix cache / looked up",
                s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0),
            "deepinfer_host_kv_blocks_used": ("host-tier blocks in use", s.host_blocks_used),
            "deepinfer_swa_snapshots": ("sliding-window snapshots held by the prefix cache",
                                        s.swa_snapshots),
            "deepinfer_kv_transfers_pending": (
                "KV transfers under way: prompts held for a decode server (prefill) or being "
                "pulled (decode)", s.kv_transfers_pending),
        }
        for name, (doc, value) in gauges.items():
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            yield g
        counters = {
            "deepinfer_num_preemptions": ("requests preempted", s.num_preemptions),
            "deepinfer_engine_steps": ("scheduler steps", s.num_steps),
            "deepinfer_prefix_cache_queries_tokens": (
                "prompt tokens looked up in the prefix cache", s.prefix_cache_queries),
            "deepinfer_prefix_cache_hits_tokens": (
                "prompt tokens served from the prefix cache", s.prefix_cache_hits),
            "deepinfer_prefix_cache_evictions_blocks": (
                "blocks evicted from the prefix cache", s.prefix_cache_evictions),
            "deepinfer_swa_replayed_tokens": (
                "tokens recomputed to rebuild sliding windows after prefix hits",
                s.replayed_tokens),
            "deepinfer_swa_snapshot_hits": (
                "prefix hits that resumed the sliding layers from a window snapshot",
                s.swa_snapshot_hits),
            "deepinfer_host_kv_blocks_out": ("blocks copied to the host tier", s.host_blocks_out),
            "deepinfer_host_kv_blocks_in": ("blocks copied back from the host tier",
                                            s.host_blocks_in),
        }
        for name, (doc, value) in counters.items():
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(value))
            yield c
        # Where step time goes (engine overhead = everything but forward).
        phases = CounterMetricFamily("deepinfer_step_phase_seconds",
                                     "cumulative seconds per step phase", labels=["phase"])
        for phase in ("schedule", "update", "wait", "forward", "sample", "detokenize"):
            phases.add_metric([phase], float(getattr(s, f"{phase}_seconds")))
        yield phases
        yield from _spec_decode_metrics(s)
        yield from _kv_transfer_metrics(s)


def _kv_transfer_metrics(s: SchedulerStats) -> Iterator[Metric]:
    """Prefill/decode disaggregation: what moved (sent by a prefill server, received by a
    decode server) and how long each transfer took (first read to release)."""
    for name, doc, value in (
            ("deepinfer_kv_transfer_blocks", "KV blocks transferred", s.kv_transfer_blocks),
            ("deepinfer_kv_transfer_bytes", "KV bytes transferred (all ranks)",
             s.kv_transfer_bytes)):
        c = CounterMetricFamily(name, doc)
        c.add_metric([], float(value))
        yield c
    counts = s.kv_transfer_buckets or [0] * (len(KV_TRANSFER_BUCKETS) + 1)
    cumulative, total = [], 0
    for bound, count in zip((*map(str, KV_TRANSFER_BUCKETS), "+Inf"), counts):
        total += count
        cumulative.append((bound, float(total)))
    h = HistogramMetricFamily("deepinfer_kv_transfer_seconds", "seconds per KV transfer")
    h.add_metric([], cumulative, sum_value=s.kv_transfer_seconds)
    yield h


def _spec_decode_metrics(s: SchedulerStats) -> Iterator[Metric]:
    """Speculative decoding counters (zero while it is off). CounterMetricFamily appends
    `_total` to each name, so these render as deepinfer_spec_decode_*_total."""
    counters = {
        "deepinfer_spec_decode_draft_tokens": ("draft tokens verified", s.spec_draft_tokens),
        "deepinfer_spec_decode_accepted_tokens": (
            "draft tokens the target model accepted", s.spec_accepted_tokens),
        "deepinfer_spec_decode_verify_steps": (
            "(request, step) pairs that verified at least one draft", s.spec_verify_steps),
    }
    for name, (doc, value) in counters.items():
        c = CounterMetricFamily(name, doc)
        c.add_metric([], float(value))
        yield c
    by_position = {
        "deepinfer_spec_decode_draft_tokens_per_position": (
            "draft tokens verified at each draft position", s.spec_drafts_by_position),
        "deepinfer_spec_decode_accepted_tokens_per_position": (
            "draft tokens accepted at each draft position", s.spec_accepted_by_position),
    }
    for name, (doc, values) in by_position.items():
        c = CounterMetricFamily(name, doc, labels=["position"])
        for position, value in enumerate(values):
            c.add_metric([str(position)], float(value))
        yield c
    rate = GaugeMetricFamily("deepinfer_spec_decode_acceptance_rate",
                             "accepted / verified draft tokens (0 before any draft)")
    drafts = s.spec_draft_tokens
    rate.add_metric([], s.spec_accepted_tokens / drafts if drafts else 0.0)
    yield rate


class Metrics:
    def __init__(self, state: ServerState) -> None:
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
        r.register(EngineStatsCollector(state))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
