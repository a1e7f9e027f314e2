"""DeepInfer against llama.cpp's llama-server on the same model file, over HTTP, one server at a
time: batch-1 decode, concurrent streams, and a long prompt's prefill (issue 54's tables).

    LLAMA_SERVER=/path/to/llama-server .venv/bin/python scripts/bench_real_sizes.py \\
        --model /tmp/models/1b/Q4_K_M.gguf [--llama-gguf FILE] [--streams 8] [--rounds 2] \\
        [--result-file r.json]

`--model`: what DeepInfer serves (a GGUF file, or an HF directory such as scripts/
bench_models.py's bf16 checkpoint); `--llama-gguf`: llama-server's file (default: the same GGUF;
for an HF directory, its bf16 GGUF). Per system and round:

* start-up: seconds from the command to /health answering 200;
* batch 1: one request of `--input-len` random prompt tokens generating `--batch-1-tokens`;
  decode tok/s = (tokens - 1) / (end - first token);
* streams: `--streams` concurrent requests of `--input-len` / `--output-len` tokens: output
  tok/s over the wall time, TTFT and ITL p50 / p99;
* prefill: one prompt of `--long-prompt` tokens generating 1: TTFT and prompt tok/s.

`--startup-only`: only the start-up, twice per system: with the page cache dropped first (cold:
the model file read from disk; needs root for /proc/sys/vm/drop_caches) and again (warm).

Prompts are random token ids, fresh for every request (no prefix reuse: DeepInfer's prefix cache
never hits, and llama-server gets `cache_prompt: false` and `--cache-ram 0`); every request
ignores EOS and must return exactly the tokens asked (checked). Both get `--threads` threads
(llama-server `-t/-tb`, DeepInfer `--worker-threads`) and the same context per slot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_server  # noqa: E402  (sibling scripts)
from server_process import ServerProcess  # noqa: E402


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


async def _stream(session, url: str, prompt: list[int], tokens: int, model: str
                  ) -> dict[str, Any]:
    """One streamed /v1/completions request: first-token time, gaps, end, tokens counted."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0,
            "stream": True, "ignore_eos": True, "cache_prompt": False,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    times: list[float] = []
    usage_tokens = 0
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            obj = json.loads(line[5:])
            if obj.get("choices") and obj["choices"][0].get("text"):
                times.append(time.perf_counter())
            usage_tokens = (obj.get("usage") or {}).get("completion_tokens", usage_tokens)
    n = usage_tokens or len(times)
    if n != tokens:
        raise RuntimeError(f"{url}: asked for {tokens} tokens, got {n}")
    return {"ttft": times[0] - start, "end": times[-1] - start,
            "itl": [b - a for a, b in zip(times, times[1:])], "tokens": n}


class Workload:
    def __init__(self, args: argparse.Namespace, vocab: int) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.vocab = vocab

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]

    async def run(self, url: str) -> dict[str, float]:
        import aiohttp

        a = self.args
        timeout = aiohttp.ClientTimeout(total=3600)
        # One connection a request: llama-server closes a streamed response's connection, and
        # a pooled one found closed fails the next request.
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            async with session.get(url + "/v1/models") as resp:
                model = (await resp.json())["data"][0]["id"]
            await _stream(session, url, self.prompt(a.input_len), 8, model)  # warm-up
            one = await _stream(session, url, self.prompt(a.input_len), a.batch_1_tokens, model)
            start = time.perf_counter()
            many = await asyncio.gather(*[
                _stream(session, url, self.prompt(a.input_len), a.output_len, model)
                for _ in range(a.streams)])
            wall = time.perf_counter() - start
            long = await _stream(session, url, self.prompt(a.long_prompt), 1, model)
        itl = [g for r in many for g in r["itl"]]
        ttft = [r["ttft"] for r in many]
        return {
            "batch1_tok_s": (one["tokens"] - 1) / (one["end"] - one["ttft"]),
            "streams_tok_s": sum(r["tokens"] for r in many) / wall,
            "ttft_p50_ms": 1e3 * _pct(ttft, 50), "ttft_p99_ms": 1e3 * _pct(ttft, 99),
            "itl_p50_ms": 1e3 * _pct(itl, 50), "itl_p99_ms": 1e3 * _pct(itl, 99),
            "prefill_ttft_ms": 1e3 * long["ttft"], "prefill_tok_s": a.long_prompt / long["ttft"],
        }


def context_per_slot(args: argparse.Namespace) -> int:
    return max(args.input_len + max(args.output_len, args.batch_1_tokens), args.long_prompt + 1)


def drop_page_cache() -> None:
    """Every clean page of the page cache dropped (the model file's included): a cold start."""
    import os

    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1\n")


def run_deepinfer(args: argparse.Namespace, work: Workload | None) -> dict[str, float]:
    ctx = context_per_slot(args)
    start = time.perf_counter()
    server = ServerProcess(args.model, "--worker-threads", str(args.threads),
                           "--max-model-len", str(max(ctx, args.max_model_len)),
                           "--max-num-seqs", str(max(args.streams, 1)), *args.deepinfer_args,
                           timeout=1800)
    up = time.perf_counter() - start
    if work is None:
        server.stop()
        return {"startup_s": up}
    try:
        result = asyncio.run(work.run(server.base_url))
        memory = [line for line in server.output().splitlines() if " memory: " in line]
    finally:
        server.stop()
    return {"startup_s": up, **result, "memory": memory[-1].split(" memory: ")[-1]
            if memory else ""}


def run_llama(args: argparse.Namespace, work: Workload | None, binary: str
              ) -> dict[str, float]:
    slots = max(args.streams, 1)
    spec = llama_server.ServerSpec(binary, args.llama_gguf, slots,
                                   llama_server.context_size(slots, context_per_slot(args)),
                                   args.threads)
    start = time.perf_counter()
    with llama_server.LlamaServer(spec) as server:
        server.wait_healthy(timeout=1800)
        up = time.perf_counter() - start
        if work is None:
            return {"startup_s": up}
        result = asyncio.run(work.run(server.base_url))
    return {"startup_s": up, **result}


COLUMNS = [("startup_s", "start s", "{:.1f}"), ("batch1_tok_s", "batch-1 tok/s", "{:.1f}"),
           ("streams_tok_s", "streams tok/s", "{:.1f}"), ("ttft_p50_ms", "TTFT p50", "{:.0f}"),
           ("ttft_p99_ms", "TTFT p99", "{:.0f}"), ("itl_p50_ms", "ITL p50", "{:.1f}"),
           ("itl_p99_ms", "ITL p99", "{:.1f}"), ("prefill_tok_s", "prefill tok/s", "{:.1f}")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--llama-gguf", default=None)
    ap.add_argument("--llama-server", default=None, metavar="PATH")
    ap.add_argument("--systems", default="deepinfer,llama-server")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--batch-1-tokens", type=int, default=128)
    ap.add_argument("--long-prompt", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="DeepInfer's context (default: what the workload needs)")
    ap.add_argument("--rounds", type=int, default=1, help="systems alternate, round by round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deepinfer-arg", dest="deepinfer_args", action="append", default=[],
                    help="one more `deepinfer serve` argument (repeat)")
    ap.add_argument("--startup-only", action="store_true",
                    help="only time start-up, cold (page cache dropped) then warm")
    ap.add_argument("--result-file", default=None)
    args = ap.parse_args()
    if args.llama_gguf is None:
        args.llama_gguf = args.model if args.model.endswith(".gguf") else None
    from deepinfer.engine.model_store import ensure_model

    vocab = json.loads((Path(ensure_model(args.model)) / "config.json").read_text())["vocab_size"]
    systems = [s for s in args.systems.split(",") if s]
    binary = llama_server.find_binary(args.llama_server)
    if "llama-server" in systems and (binary is None or args.llama_gguf is None):
        print(llama_server.missing_binary_message(args.llama_server) if binary is None
              else "llama-server: no --llama-gguf for an HF model; skipped")
        systems.remove("llama-server")
    rows: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    if args.startup_only:
        for system in systems:
            for label in ("cold", "warm"):
                if label == "cold":
                    drop_page_cache()
                up = (run_deepinfer(args, None) if system == "deepinfer"
                      else run_llama(args, None, binary))["startup_s"]
                print(f"{system} start-up to /health, {label} page cache: {up:.1f} s", flush=True)
        print("command: " + " ".join(sys.argv))
        return
    for r in range(args.rounds):
        for system in systems:
            work = Workload(args, vocab)
            work.rng.seed(args.seed * 1000 + r)  # the same prompts for both systems each round
            print(f"round {r + 1}: {system} ...", flush=True)
            rows[system].append(run_deepinfer(args, work) if system == "deepinfer"
                                else run_llama(args, work, binary))
    print(f"\n{args.model} ({args.threads} threads, {args.streams} streams of {args.input_len}/"
          f"{args.output_len}, prefill {args.long_prompt}); mean of {args.rounds} round(s)")
    print("| system | " + " | ".join(h for _, h, _ in COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    means = {s: {k: statistics.mean(x[k] for x in rs) for k, _, _ in COLUMNS}
             for s, rs in rows.items()}
    for s, m in means.items():
        print(f"| {s} | " + " | ".join(f.format(m[k]) for k, _, f in COLUMNS) + " |")
    if len(means) == 2:
        d, ll = means["deepinfer"], means["llama-server"]
        print(f"DeepInfer / llama-server: batch 1 {d['batch1_tok_s'] / ll['batch1_tok_s']:.2f}x, "
              f"streams {d['streams_tok_s'] / ll['streams_tok_s']:.2f}x, prefill "
              f"{d['prefill_tok_s'] / ll['prefill_tok_s']:.2f}x")
    for s, rs in rows.items():
        if rs and rs[-1].get("memory"):
            print(f"{s} memory: {rs[-1]['memory']}")
    print("command: " + " ".join(sys.argv))
    if args.result_file:
        Path(args.result_file).write_text(json.dumps({"args": vars(args), "rounds": rows,
                                                      "means": means}, indent=1))


if __name__ == "__main__":
    main()
