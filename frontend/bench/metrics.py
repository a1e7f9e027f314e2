"""Per-request timings -> the benchmark report (throughput, latency percentiles, goodput)."""

from __future__ import annotations

from typing import Any

import numpy as np

from deepinfer.frontend.bench.client import RequestResult

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:100"]` -> {"ttft": 500.0, "tpot": 100.0} (milliseconds)."""
    slos = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in SLO_METRICS or not value:
            raise ValueError(f"bad --goodput item {item!r}; use NAME:MS with NAME in {SLO_METRICS}")
        slos[name] = float(value)
    return slos


def tpot(r: RequestResult) -> float | None:
    if r.output_tokens <= 1:
        return None
    return (r.e2e - r.ttft) / (r.output_tokens - 1)


def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0 if values_s else np.zeros(1)
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms))}
    for p in PERCENTILES[1:]:
        out[f"p{p}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def _meets(r: RequestResult, slos: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": tpot(r) or 0.0, "e2el": r.e2e}
    return all(values[k] * 1000.0 <= limit for k, limit in slos.items())


def summarize(results: list[RequestResult], duration: float,
              slos: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    report: dict[str, Any] = {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
    }
    if slos:
        good = sum(1 for r in ok if _meets(r, slos))
        report["goodput_slos_ms"] = slos
        report["goodput"] = good / duration if duration else 0.0
        report["good_requests"] = good
    report |= _stats("ttft", [r.ttft for r in ok])
    report |= _stats("tpot", [t for r in ok if (t := tpot(r)) is not None])
    report |= _stats("itl", [x for r in ok for x in r.itl])
    report |= _stats("e2el", [r.e2e for r in ok])
    return report


def format_report(report: dict[str, Any]) -> str:
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<44}{text:>16}")

    row("Successful requests:", report["completed"])
    row("Failed requests:", report["failed"])
    row("Benchmark duration (s):", report["duration_s"])
    row("Total input tokens:", report["total_input_tokens"])
    row("Total generated tokens:", report["total_output_tokens"])
    row("Request throughput (req/s):", report["request_throughput"])
    row("Output token throughput (tok/s):", report["output_throughput"])
    row("Total token throughput (tok/s):", report["total_token_throughput"])
    if "goodput" in report:
        row("Request goodput (req/s):", report["goodput"])
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for key, title in titles.items():
        lines.append("{s:{c}^60}".format(s=f" {title} ", c="-"))
        for stat in ("mean", "median", "p90", "p99"):
            row(f"{stat.capitalize()} {key.upper()} (ms):", report[f"{stat}_{key}_ms"])
    if report.get("spec_decode_acceptance_rate") is not None:
        lines.append("{s:{c}^60}".format(s=" Speculative Decoding (server) ", c="-"))
        row("Acceptance rate:", report["spec_decode_acceptance_rate"])
        row("Mean accepted length (tokens/step):", report["spec_decode_mean_accepted_length"])
        by_position = report.get("spec_decode_acceptance_by_position") or []
        if by_position:
            row("Acceptance rate by draft position:",
                " ".join("-" if r is None else f"{r:.2f}" for r in by_position))
    lines.append("=" * 60)
    return "\n".join(lines)
