"""Pictures of a benchmark (matplotlib, drawn without a display): one run's latency
distributions and throughput over time (`bench serve --plot`), and concurrency sweeps'
throughput against latency (`bench sweep`, with `--compare` several servers' sweeps in one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plots need matplotlib: pip install 'deepinfer[plot]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def output_rate(token_times: list[float], duration: float, bins: int = 40
                ) -> tuple[np.ndarray, np.ndarray]:
    """Streamed chunks per second over the run: (bin centres, rate)."""
    edges = np.linspace(0.0, max(duration, 1e-9), bins + 1)
    counts, _ = np.histogram(token_times, bins=edges)
    width = edges[1] - edges[0]
    return (edges[:-1] + edges[1:]) / 2, counts / width


def plot_run(report: dict[str, Any], path: str | Path) -> None:
    """TTFT and inter-token latency distributions, and output chunks/s over the run."""
    plt = _pyplot()
    fig, (ttft, itl, rate) = plt.subplots(1, 3, figsize=(15, 4.2))
    ttfts = np.asarray(report["ttfts"]) * 1e3
    itls = np.asarray(report["itls"]) * 1e3
    ttft.hist(ttfts, bins=30, color="tab:blue")
    ttft.set(title="time to first token", xlabel="ms", ylabel="requests")
    itl.hist(itls, bins=50, color="tab:orange")
    itl.set(title="inter-token latency", xlabel="ms", ylabel="chunks")
    for ax, values in ((ttft, ttfts), (itl, itls)):
        for q, style in ((50, "-"), (99, "--")):
            if len(values):
                ax.axvline(np.percentile(values, q), color="black", linestyle=style,
                           label=f"p{q}")
        ax.legend()
    x, y = output_rate(report["token_times"], report["duration_s"])
    rate.plot(x, y, color="tab:green")
    rate.set(title="output over the run", xlabel="s", ylabel="chunks / s")
    fig.suptitle(f"{report['model']} at {report['base_url']}: {report['completed']} requests, "
                 f"{report['output_throughput']:.0f} tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# One sweep's levels with the name its lines carry in the legend.
Sweep = tuple[str, list[dict[str, Any]]]


def sweep_figure(sweeps: list[Sweep]):
    """Per concurrency level: output tok/s against TTFT and ITL (p50 and p99), one colour per
    sweep, so servers measured apart share one picture. Returns the matplotlib figure."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, title in ((axes[0], "ttft", "time to first token"),
                           (axes[1], "itl", "inter-token latency")):
        for index, (label, levels) in enumerate(sweeps):
            _draw_sweep(ax, key, label, levels, color=f"C{index % 10}")
        ax.set(title=f"throughput against {title}", xlabel="ms", ylabel="output tok/s")
        ax.legend(fontsize=8)
    fig.suptitle("concurrency sweep (points labelled by concurrency)")
    fig.tight_layout()
    return fig


def _draw_sweep(ax, key: str, label: str, levels: list[dict[str, Any]], color: str) -> None:
    tput = [lv["output_throughput"] for lv in levels]
    for q, style in (("median", "o-"), ("p99", "s--")):
        ax.plot([lv[f"{q}_{key}_ms"] for lv in levels], tput, style, color=color,
                label=f"{label} {q}".strip())
    for lv in levels:
        ax.annotate(str(lv["max_concurrency"]), (lv[f"median_{key}_ms"], lv["output_throughput"]),
                    textcoords="offset points", xytext=(4, 4), fontsize=8, color=color)


def plot_sweeps(sweeps: list[Sweep], path: str | Path) -> None:
    """Several sweeps (this one and saved ones) in one picture (`bench sweep --compare`)."""
    fig = sweep_figure(sweeps)
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)

