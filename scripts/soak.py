"""Soak test: many requests at high concurrency against a real server, nothing may be lost.

A mix of streaming and plain completions and chats, a share of clients that disconnect
mid-stream, and a share of bad requests (each must get a 400). Reports requests completed,
rejected with an explicit 503, and failed (anything else: a 5xx, a broken stream, a wrong status,
a timeout); whether the KV cache came back to where it started (free + reusable blocks == total,
nothing running or waiting); and the resident memory of every server process, sampled every
second (its drift after warm-up).

    .venv/bin/python scripts/soak.py --num-requests 1000 --concurrency 64 --result-file soak.json

Without --url it starts `deepinfer serve --model MODEL` itself and stops it afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))  # for scripts.*, after site-packages

from scripts.server_process import ServerProcess, descendants, rss_mb  # noqa: E402

# Each must be refused with a 400 (and leave nothing behind).
BAD_BODIES = [
    b'{"prompt": "x", "max_tokens": -1}',
    b'{"prompt": "x", "temperature": -2}',
    b'{"prompt": "x", "top_p": 7}',
    b'{"max_tokens": 4}',
    b'{"prompt": "x", "n": 0}',
    b'{"prompt": "x", "response_format": {"type": "json_schema", "json_schema": '
    b'{"name": "s", "schema": {"type": "nonsense"}}}}',
    b'{"prompt": "x", "logprobs": 99}',
    b'{"prompt": [1, 2, -5]}',
    b'{"prompt": "x", "stop": 12}',
    b'this is not json',
]


class RssSampler(threading.Thread):
    def __init__(self, pid: int, interval: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.procs = {pid: "server", **descendants(pid)}
        self.samples: dict[str, list[float]] = {name: [] for name in self.procs.values()}
        self.interval, self.stopped = interval, threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            for pid, name in self.procs.items():
                mb = rss_mb(pid)
                if mb is not None:
                    self.samples[name].append(mb)
            self.stopped.wait(self.interval)

    def report(self, warmup: float) -> dict[str, dict[str, float]]:
        out = {}
        for name, values in self.samples.items():
            if not values:
                continue
            settled = values[min(int(len(values) * warmup), len(values) - 1):]
            out[name] = {"start_mb": values[0], "after_warmup_mb": settled[0],
                         "end_mb": values[-1], "max_mb": max(values),
                         "drift_after_warmup_mb": values[-1] - settled[0]}
        return out


async def one(session: aiohttp.ClientSession, url: str, kind: str, i: int,
              max_tokens: int, model: str) -> str:
    """The outcome of one request: completed, rejected, bad_ok, disconnected or failed:<why>."""
    if kind == "bad":
        body = BAD_BODIES[i % len(BAD_BODIES)]
        async with session.post(f"{url}/v1/completions", data=body,
                                headers={"Content-Type": "application/json"}) as r:
            await r.read()
            return "bad_ok" if r.status == 400 else f"failed:bad got {r.status}"
    stream = kind in ("stream", "disconnect")
    chat = i % 2 == 0
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.7, "seed": i,
            "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": f"Request {i}: tell me something."}]
    else:
        body["prompt"] = f"Request {i}: once upon a time"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with session.post(f"{url}{path}", json=body) as r:
        if r.status == 503:
            await r.read()
            return "rejected"
        if r.status != 200:
            return f"failed:status {r.status}"
        if not stream:
            data = await r.json()
            return "completed" if data["choices"][0]["finish_reason"] else "failed:no finish"
        done = False
        async for raw in r.content:
            line = raw.decode().strip()
            if kind == "disconnect" and line.startswith("data: "):
                return "disconnected"  # leaving the block closes the connection mid-stream
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: ") and '"error"' in line:
                return "failed:stream error"
        return "completed" if done else "failed:stream ended early"


async def load(url: str, args: argparse.Namespace) -> dict[str, int]:
    rng = random.Random(args.seed)
    kinds = []
    for _ in range(args.num_requests):
        x = rng.random()
        kinds.append("bad" if x < args.bad_share else
                     "disconnect" if x < args.bad_share + args.disconnect_share else
                     "stream" if rng.random() < 0.5 else "plain")
    counts: dict[str, int] = {}
    gate = asyncio.Semaphore(args.concurrency)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def run(i: int, kind: str) -> None:
            async with gate:
                try:
                    outcome = await one(session, url, kind, i, args.max_tokens, args.model_name)
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    outcome = f"failed:{type(exc).__name__}"
            key = outcome.split(":")[0]
            counts[key] = counts.get(key, 0) + 1
            if key == "failed":
                counts.setdefault("failures", []).append(outcome)

        await asyncio.gather(*(run(i, k) for i, k in enumerate(kinds)))
    return counts


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    return float(m[1]) if m else float("nan")


def kv_settled(url: str, timeout: float = 30.0) -> dict[str, float]:
    """The engine's KV cache once nothing runs or waits (aborted requests take a step to go)."""
    deadline = time.monotonic() + timeout
    while True:
        state = {n: metric(url, f"deepinfer_{n}") for n in (
            "num_requests_running", "num_requests_waiting", "kv_blocks_free", "kv_blocks_total")}
        idle = not state["num_requests_running"] and not state["num_requests_waiting"]
        if (idle and state["kv_blocks_free"] == state["kv_blocks_total"]) or (
                time.monotonic() > deadline):
            return state
        time.sleep(0.5)


def soak(args: argparse.Namespace) -> dict:
    server = None
    url = args.url
    if url is None:
        server = ServerProcess(args.model, *(args.server_arg or []), timeout=600)
        url = server.base_url
    try:
        sampler = RssSampler(server.proc.pid if server else os.getpid())
        sampler.start()
        t0 = time.perf_counter()
        counts = asyncio.run(load(url, args))
        elapsed = time.perf_counter() - t0
        kv = kv_settled(url)
        with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
            healthy = r.status == 200
        sampler.stopped.set()
        sampler.join()
        return {"requests": args.num_requests, "seconds": elapsed, "outcomes": counts,
                "kv": kv, "kv_leaked_blocks": kv["kv_blocks_total"] - kv["kv_blocks_free"],
                "healthy_after": healthy, "rss": sampler.report(args.warmup_share)}
    finally:
        if server is not None:
            server.stop()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--model", default="default", help="when starting the server")
    p.add_argument("--server-arg", action="append", help="extra `deepinfer serve` argument")
    p.add_argument("--model-name", default="default", help="the `model` field sent")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--bad-share", type=float, default=0.1)
    p.add_argument("--disconnect-share", type=float, default=0.1)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--warmup-share", type=float, default=0.2,
                   help="share of the RSS samples before which memory may still grow")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = soak(args)
    result["command"] = " ".join(["scripts/soak.py", *(argv or sys.argv[1:])])
    print(json.dumps(result, indent=2))
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=2))
    failed = result["outcomes"].get("failed", 0)
    return 0 if not failed and not result["kv_leaked_blocks"] and result["healthy_after"] else 1


if __name__ == "__main__":
    sys.exit(main())
