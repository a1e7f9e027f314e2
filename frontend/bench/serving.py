"""Serving benchmark: load any OpenAI-compatible server and report latency and throughput.

`deepinfer bench serve ...` and `python scripts/bench_serving.py ...` both land here;
`deepinfer bench sweep` runs it at several concurrency levels (frontend/bench/plots.py draws
both).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from deepinfer.frontend.bench.client import RequestResult, payload, send
from deepinfer.frontend.bench.datasets import (
    BenchRequest,
    input_grounded_requests,
    random_requests,
    shared_prefix_requests,
)
from deepinfer.frontend.bench.metrics import format_report, parse_goodput, summarize
from deepinfer.frontend.bench.spec_decode import scrape_spec_counters, spec_report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions",
                   choices=["/v1/completions", "/v1/chat/completions", "/v1/messages"])
    p.add_argument("--model", default=None, help="default: the first model of /v1/models")
    p.add_argument("--dataset", default="random",
                   choices=["random", "shared-prefix", "input-grounded"],
                   help="input-grounded: fixed chat prompts whose answers copy them (n-gram "
                        "speculation's workload); needs --endpoint /v1/chat/completions")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly in [len*(1-r), len*(1+r)]")
    p.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: prefix words")
    p.add_argument("--grounded-max-tokens", type=int, default=256,
                   help="input-grounded: max_tokens of each answer (which ends at EOS)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--num-warmups", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (for servers that reject it)")
    p.add_argument("--goodput", nargs="*", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:100 e2el:5000")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", default=None, help="default: bench-<timestamp>.json")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="draw TTFT and inter-token latency distributions and output over time")
    p.add_argument("--disable-tqdm", action="store_true")


def check_args(args: argparse.Namespace) -> None:
    """Refuse combinations that would measure something else than asked (ValueError)."""
    if args.dataset == "input-grounded" and args.endpoint != "/v1/chat/completions":
        # The prompts are user messages: as raw completion text the model would not answer them.
        raise ValueError("--dataset input-grounded needs --endpoint /v1/chat/completions")


def build_requests(args: argparse.Namespace) -> list[BenchRequest]:
    if args.dataset == "input-grounded":
        return input_grounded_requests(args.num_prompts, args.grounded_max_tokens)
    if args.dataset == "shared-prefix":
        return shared_prefix_requests(args.num_prompts, args.prefix_len, args.random_input_len,
                                      args.random_output_len, args.random_range_ratio, args.seed)
    return random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                           args.random_range_ratio, args.seed)


async def _first_model(session, base_url: str) -> str:
    async with session.get(f"{base_url}/v1/models") as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp
    from tqdm import tqdm

    base_url = args.base_url.rstrip("/")
    url = base_url + args.endpoint
    requests = build_requests(args)
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = args.model or await _first_model(session, base_url)

        def body(req: BenchRequest) -> dict[str, Any]:
            return payload(args.endpoint, model, req, args.temperature, args.ignore_eos)

        for req in requests[: args.num_warmups]:
            warm = await send(session, url, body(req))
            if not warm.ok:
                print(f"warm-up request failed: {warm.error}", file=sys.stderr)
        limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = tqdm(total=len(requests), disable=args.disable_tqdm)

        async def one(req: BenchRequest) -> RequestResult:
            if limit is None:
                result = await send(session, url, body(req))
            else:
                async with limit:
                    result = await send(session, url, body(req))
            bar.update(1)
            return result

        # After the warm-ups: only the measured requests count.
        spec_before = await scrape_spec_counters(session, base_url)
        rng = random.Random(args.seed)
        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(one(req)))
            if math.isfinite(args.request_rate) and args.request_rate > 0:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
        spec_after = await scrape_spec_counters(session, base_url)
    report = summarize(results, duration, parse_goodput(args.goodput))
    report |= spec_report(spec_before, spec_after)
    errors = sorted({r.error for r in results if not r.ok})
    report |= {
        "model": model, "base_url": base_url, "endpoint": args.endpoint,
        "dataset": args.dataset, "num_prompts": len(requests),
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency, "errors": errors[:10],
        "input_lens": [r.prompt_tokens for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results], "e2els": [r.e2e for r in results],
        "itls": [x for r in results if r.ok for x in r.itl],
        # When each streamed chunk arrived, seconds from the start (output over time).
        "token_times": [t for r in results if r.ok for t in _arrivals(r, start)],
    }
    return report


def _arrivals(r: RequestResult, start: float) -> list[float]:
    first = r.start - start + r.ttft
    return [first, *(first + np.cumsum(r.itl)).tolist()]


def run(args: argparse.Namespace) -> int:
    try:
        check_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = asyncio.run(benchmark(args))
    print(format_report(report))
    for err in report["errors"]:
        print(f"error: {err}", file=sys.stderr)
    path = Path(args.result_file or time.strftime("bench-%Y%m%d-%H%M%S.json"))
    path.write_text(json.dumps(report, indent=2))
    print(f"results written to {path}")
    if args.plot:
        from deepinfer.frontend.bench.plots import plot_run

        plot_run(report, args.plot)
        print(f"plot written to {args.plot}")
    return 0 if report["completed"] else 1


# What a sweep keeps of each level's report (the per-request lists stay out).
SWEEP_FIELDS = ("max_concurrency", "num_prompts", "completed", "failed", "duration_s",
                "request_throughput", "output_throughput", "total_token_throughput",
                "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p90_itl_ms",
                "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms")


def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    add_arguments(p)
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64",
                   help="comma-separated concurrency levels, each run with --num-prompts")
    p.add_argument("--label", default=None,
                   help="this sweep's name in the plot and its JSON (default: MODEL at BASE_URL)")
    p.add_argument("--compare", action="extend", nargs="+", default=[],
                   metavar="SWEEP.json[=LABEL]",
                   help="earlier sweeps' JSON files (another server's, say) drawn in the same "
                        "plot, each named LABEL or by the label it recorded")


def _levels(text: str) -> list[int]:
    try:
        levels = [int(c) for c in text.split(",")]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency must be positive integers such as 1,2,4, not {text!r}")
    return levels


def sweep_label(saved: dict[str, Any]) -> str:
    """A saved sweep's name: the label it recorded, else its model and server."""
    return saved.get("label") or f"{saved['model']} at {saved['base_url']}"


def load_compared(spec: str) -> tuple[str, list[dict[str, Any]]]:
    """`SWEEP.json[=LABEL]` -> (label, levels); ValueError naming what is wrong."""
    path, _, label = (spec, "", "") if Path(spec).is_file() else spec.partition("=")
    try:
        saved = json.loads(Path(path).read_text())
        levels = saved["levels"]
        return label or sweep_label(saved), levels
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--compare {spec}: not a saved sweep ({type(exc).__name__}: {exc})"
                         ) from None


def _sweep_levels(args: argparse.Namespace, levels: list[int]
                  ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`bench serve` at each level: the kept fields per level, and the last full report. Each
    level draws its own prompts (--seed plus the level's index): a server never answers a level
    from the KV an earlier level left (llama-server's slots keep their last prompt's)."""
    rows = []
    first_seed = args.seed
    for i, level in enumerate(levels):
        args.max_concurrency, args.seed = level, first_seed + i
        report = asyncio.run(benchmark(args))
        rows.append({k: report[k] for k in SWEEP_FIELDS})
        print(f"concurrency {level:>4}: {report['output_throughput']:8.1f} tok/s, TTFT p50 "
              f"{report['median_ttft_ms']:.0f} ms p99 {report['p99_ttft_ms']:.0f} ms, ITL p50 "
              f"{report['median_itl_ms']:.1f} ms p99 {report['p99_itl_ms']:.1f} ms", flush=True)
    return rows, report


def sweep(args: argparse.Namespace) -> int:
    """`bench serve` at each --concurrency level: one JSON of the levels and one plot (with the
    --compare sweeps beside it)."""
    try:
        check_args(args)
        levels = _levels(args.concurrency)
        compared = [load_compared(spec) for spec in args.compare]  # before any long run
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows, report = _sweep_levels(args, levels)
    saved = {"model": report["model"], "base_url": report["base_url"],
             "endpoint": args.endpoint, "label": args.label, "levels": rows}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(args.result_file or f"sweep-{stamp}.json")
    path.write_text(json.dumps(saved, indent=2))
    plot = args.plot or str(path.with_suffix(".png"))
    from deepinfer.frontend.bench.plots import plot_sweeps

    plot_sweeps([(sweep_label(saved), rows), *compared], plot)
    print(f"results written to {path}, plot to {plot}")
    return 0 if all(r["completed"] for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
