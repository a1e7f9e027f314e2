"""Prefill/decode disaggregation against one colocated server, under a mixed workload.

The workload, for --duration seconds: --short-streams short-prompt requests stream at all times
(--short-input words, about one token each, and --short-output tokens; each re-issued as it
ends), while a long prompt (--long-input words, its own text so no prefix is shared, and
--long-output tokens) arrives every --long-interval seconds. In one server the long prompts'
prefill steps stall the short streams' decoding; split over a prefill and a decode server they
should not. TTFT and inter-token latency (p50, p99) are reported for short and long requests
apart.

- colocated: one `deepinfer serve` with --worker-threads threads;
- disaggregated: a prefill and a decode server (`--disaggregation-mode prefill|decode`) with
  --worker-threads / 2 threads each (the same cores in all), behind `deepinfer router
  --prefill URL --decode URL`. The decode server's KV transfer throughput,
  deepinfer_kv_transfer_bytes_total / deepinfer_kv_transfer_seconds_sum, is read from its
  /metrics after the run.

    .venv/bin/python scripts/bench_pd.py --result-file pd.json
    .venv/bin/python scripts/bench_pd.py --modes colocated --duration 10   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shlex
import sys
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))  # for scripts.*, after site-packages

from deepinfer.frontend.bench.client import RequestResult, payload, send  # noqa: E402
from deepinfer.frontend.bench.datasets import BenchRequest, random_requests  # noqa: E402
from deepinfer.frontend.bench.metrics import summarize  # noqa: E402
from scripts.server_process import ServerProcess  # noqa: E402

MODES = ("colocated", "disaggregated")
KV_BYTES, KV_SECONDS = "deepinfer_kv_transfer_bytes_total", "deepinfer_kv_transfer_seconds_sum"


# ---------------------------------------------------------------------------- processes


def start_router(prefill: str, decode: str) -> ServerProcess:
    """`deepinfer router --prefill URL --decode URL` on a free port, once it is healthy."""
    return ServerProcess(None, "--prefill", prefill, "--decode", decode, command="router",
                         timeout=60.0)


def serve_args(args: argparse.Namespace, threads: int, *extra: str) -> list[str]:
    return ["--model", args.model, "--worker-threads", str(threads),
            *shlex.split(args.serve_args), *extra]


# ---------------------------------------------------------------------------- workload


def long_request(args: argparse.Namespace, i: int) -> BenchRequest:
    """The i-th long prompt: random words of its own, so no prefix cache serves it."""
    req = random_requests(1, args.long_input, args.long_output, 0.0, args.seed + 1_000_003 * i)[0]
    req.prompt = f"Document {i}: {req.prompt}"
    return req


def short_request(args: argparse.Namespace, i: int) -> BenchRequest:
    return random_requests(1, args.short_input, args.short_output, 0.0, args.seed + i)[0]


async def workload(url: str, args: argparse.Namespace) -> dict[str, list[RequestResult]]:
    endpoint = f"{url}{args.endpoint}"
    body = lambda req: payload(args.endpoint, args.model, req, 0.0, ignore_eos=True)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600),
                                     connector=connector) as session:
        # Warm-up, not measured: first-use costs (compilation, allocation) on every server.
        for warm in (short_request(args, -1), long_request(args, -1)):
            result = await send(session, endpoint, body(warm))
            if not result.ok:
                raise RuntimeError(f"warm-up request failed: {result.error}")
        deadline = time.perf_counter() + args.duration
        short: list[RequestResult] = []

        async def stream(slot: int) -> None:
            n = 0
            while time.perf_counter() < deadline:
                req = short_request(args, slot + n * args.short_streams)
                short.append(await send(session, endpoint, body(req)))
                n += 1

        async def arrivals() -> list[RequestResult]:
            tasks, i = [], 0
            while time.perf_counter() < deadline:
                tasks.append(asyncio.create_task(send(session, endpoint,
                                                      body(long_request(args, i)))))
                i += 1
                await asyncio.sleep(args.long_interval)
            return list(await asyncio.gather(*tasks))

        streams = [stream(s) for s in range(args.short_streams)]
        *_, long = await asyncio.gather(*streams, arrivals())
    return {"short": short, "long": long}


def report(results: dict[str, list[RequestResult]], duration: float) -> dict[str, Any]:
    out = {}
    for kind, rs in results.items():
        s = summarize(rs, duration, {})
        errors = sorted({r.error for r in rs if not r.ok})
        out[kind] = {"requests": s["completed"], "failed": s["failed"], "errors": errors[:5],
                     "output_tok_s": s["output_throughput"],
                     **{k: s[k] for k in ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms",
                                          "p99_itl_ms")}}
    return out


# ---------------------------------------------------------------------------- KV transfer


def kv_transfer(decode_url: str) -> dict[str, Any]:
    """Bytes and seconds of KV pulled by the decode server, from its /metrics."""
    try:
        with urllib.request.urlopen(f"{decode_url}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError as exc:
        return {"note": f"no /metrics from the decode server: {exc}"}
    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in (KV_BYTES, KV_SECONDS):  # summed over any labels
                    totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    except ValueError:  # not Prometheus text
        return {"note": "the decode server's /metrics is not Prometheus text"}
    if len(totals) < 2:
        missing = ", ".join(n for n in (KV_BYTES, KV_SECONDS) if n not in totals)
        return {"note": f"the decode server's /metrics has no {missing}"}
    seconds = totals[KV_SECONDS]
    return {"bytes": totals[KV_BYTES], "seconds": seconds,
            "mb_s": totals[KV_BYTES] / seconds / 1e6 if seconds else None}


# ---------------------------------------------------------------------------- runs


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    threads_each = max(1, args.worker_threads // 2)
    with ExitStack() as procs:
        if mode == "colocated":
            server = ServerProcess(None, *serve_args(args, args.worker_threads), timeout=600)
            procs.callback(server.stop)
            url = server.base_url
        else:
            # The servers and their router authenticate each other with it (README "Security").
            os.environ.setdefault("DEEPINFER_CLUSTER_SECRET", secrets.token_hex(32))
            servers = {}
            for role in ("prefill", "decode"):
                server = ServerProcess(None, *serve_args(args, threads_each,
                                                         "--disaggregation-mode", role),
                                       timeout=600)
                procs.callback(server.stop)
                servers[role] = server.base_url
            router = start_router(servers["prefill"], servers["decode"])
            procs.callback(router.stop)
            url = router.base_url
        start = time.perf_counter()
        out = report(asyncio.run(workload(url, args)), args.duration)
        out["wall_s_with_warmup"] = time.perf_counter() - start
        if mode == "disaggregated":
            out["kv_transfer"] = kv_transfer(servers["decode"])
    return out


def table(out: dict[str, Any]) -> str:
    rows = ["| setup | prompts | completed | failed | TTFT p50 (ms) | TTFT p99 (ms) "
            "| ITL p50 (ms) | ITL p99 (ms) |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for mode in MODES:
        for kind in ("short", "long"):
            r = out.get(mode, {}).get(kind)
            if r:
                rows.append(f"| {mode} | {kind} | {r['requests']} | {r['failed']} "
                            f"| {r['median_ttft_ms']:.1f} | {r['p99_ttft_ms']:.1f} "
                            f"| {r['median_itl_ms']:.1f} | {r['p99_itl_ms']:.1f} |")
    kv = out.get("disaggregated", {}).get("kv_transfer")
    if kv:
        rows.append("")
        rows.append(f"KV transfer: {kv['bytes'] / 1e6:.1f} MB in {kv['seconds']:.3f} s, "
                    f"{kv['mb_s']:.1f} MB/s" if kv.get("mb_s") else
                    f"KV transfer: {kv.get('note', 'no time recorded')}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--modes", default=",".join(MODES), help="colocated, disaggregated or both")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of measured load")
    p.add_argument("--short-streams", type=int, default=8)
    p.add_argument("--short-input", type=int, default=32, help="words (~tokens) per short prompt")
    p.add_argument("--short-output", type=int, default=128)
    p.add_argument("--long-input", type=int, default=1500, help="words (~tokens) per long prompt")
    p.add_argument("--long-output", type=int, default=16)
    p.add_argument("--long-interval", type=float, default=2.0, help="seconds between long prompts")
    p.add_argument("--worker-threads", type=int, default=2,
                   help="colocated: the server's threads; disaggregated: half to each server")
    p.add_argument("--endpoint", default="/v1/completions",
                   choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--serve-args", default="", help="more `deepinfer serve` flags, for every "
                                                     "server (e.g. \"--kv-cache-gb 2\")")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", default=None)
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    if set(modes) - set(MODES):
        p.error(f"--modes takes {', '.join(MODES)}")
    out: dict[str, Any] = {"command": " ".join(["scripts/bench_pd.py", *(argv or sys.argv[1:])])}
    for mode in modes:
        out[mode] = run_mode(mode, args)
        print(mode, json.dumps(out[mode]), flush=True)
    print(table(out))
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
