"""The KV cache's tiers, measured on one machine in one run (the default model).

Part 1, `ttft`: time to first token of a 4,000-token prompt served cold, from the device cache,
from the host tier (evicted there by another prompt) and from the disk tier after a restart
(its files in the page cache, then with the page cache dropped before each request: root).
Part 2, `workload`: many conversations whose working set is --working-set-ratio times the device
and host caches together, each request a conversation's long context plus a new question;
prefix-cache hit rate and TTFT p50/p99 with and without the disk tier.

    .venv/bin/python scripts/bench_kv_tiers.py --result-file kv_tiers.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))  # for scripts.*, after site-packages

from scripts.server_process import ServerProcess  # noqa: E402

BLOCK = 16


def serve(model: str, blocks: int, host_gb: float, disk: Path | None) -> ServerProcess:
    args = ["--num-kv-blocks", str(blocks), "--host-kv-cache-gb", str(host_gb),
            "--max-model-len", "8192", "--served-model-name", "m"]
    if disk is not None:
        args += ["--kv-disk-path", str(disk)]
    return ServerProcess(model, *args, timeout=600)


def first_token(server: ServerProcess, tokens: list[int]) -> tuple[float, int]:
    """Seconds to the first (only) token, and the prompt tokens served from a cache."""
    t0 = time.perf_counter()
    r = httpx.post(f"{server.base_url}/v1/completions", timeout=600, json={
        "model": "m", "prompt": tokens, "max_tokens": 1, "temperature": 0})
    r.raise_for_status()
    usage = r.json()["usage"]
    return time.perf_counter() - t0, usage["prompt_tokens_details"]["cached_tokens"]


def drop_page_cache() -> None:
    """The files' pages leave memory (root only): the read comes from the device itself."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def written(server: ServerProcess) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    line = next(x for x in text.splitlines()
                if x.startswith('deepinfer_kv_tier_written_bytes_total{tier="disk"}'))
    return float(line.rsplit(" ", 1)[1])


def wait_saved(server: ServerProcess, nbytes: float) -> None:
    deadline = time.monotonic() + 120
    while written(server) < nbytes and time.monotonic() < deadline:
        time.sleep(0.05)


def ttft_tiers(model: str, prompt_tokens: int, reps: int, vocab: int) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(prompt_tokens)] for _ in range(reps)]
    evictor = [rng.randrange(100, vocab) for _ in range(prompt_tokens)]
    blocks = prompt_tokens // BLOCK + 40  # room for one such prompt: the next evicts it
    out: dict[str, list[float]] = {"cold": [], "device": [], "host": [], "disk": [],
                                   "disk_uncached": []}
    with tempfile.TemporaryDirectory(prefix="kv-disk-") as disk:
        server = serve(model, blocks, 4.0, Path(disk))
        try:
            first_token(server, prompts[0][:64])  # warm up
            for p in prompts:
                seconds, cached = first_token(server, p)
                out["cold"].append(seconds)
                seconds, cached = first_token(server, p)
                assert cached >= prompt_tokens - BLOCK, cached
                out["device"].append(seconds)
                first_token(server, evictor)  # moves p's blocks to the host tier
                evictor = evictor[1:] + evictor[:1]
                seconds, cached = first_token(server, p)
                assert cached >= prompt_tokens - BLOCK, cached
                out["host"].append(seconds)
            wait_saved(server, 1)
            time.sleep(2)  # the last writes
        finally:
            server.stop()
        for name in ("disk", "disk_uncached"):
            server = serve(model, blocks, 4.0, Path(disk))  # a restart: device and host empty
            try:
                first_token(server, prompts[0][:15])
                for p in prompts:
                    if name == "disk_uncached":
                        drop_page_cache()
                    seconds, cached = first_token(server, p)
                    assert cached >= prompt_tokens - BLOCK, cached
                    out[name].append(seconds)
            finally:
                server.stop()
    return {k: statistics.median(v) for k, v in out.items()} | {"samples": out}


def workload(model: str, disk_tier: bool, conversations: int, context: int, requests: int,
             blocks: int, host_gb: float, vocab: int) -> dict:
    rng = random.Random(1)
    contexts = [[rng.randrange(100, vocab) for _ in range(context)] for _ in range(conversations)]
    ttfts, prompt, cached = [], 0, 0
    with tempfile.TemporaryDirectory(prefix="kv-disk-") as disk:
        server = serve(model, blocks, host_gb, Path(disk) if disk_tier else None)
        try:
            for _ in range(requests):
                c = rng.randrange(conversations)
                question = [rng.randrange(100, vocab) for _ in range(32)]
                seconds, hit = first_token(server, contexts[c] + question)
                ttfts.append(seconds)
                prompt += context + 32
                cached += hit
        finally:
            server.stop()
    ttfts.sort()
    return {"hit_rate": cached / prompt, "ttft_p50": statistics.median(ttfts),
            "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "requests": requests, "prompt_tokens": prompt, "cached_tokens": cached}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--context", type=int, default=1600)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--device-blocks", type=int, default=200)
    ap.add_argument("--parts", default="ttft,workload")
    ap.add_argument("--result-file")
    args = ap.parse_args()
    from deepinfer.engine.config import EngineConfig
    from deepinfer.engine.model_config import FULL

    cfg = EngineConfig(model=args.model)
    vocab = cfg.model_config().vocab_size
    block_bytes = cfg.kv_bytes_per_block(cfg.kv_cache_layout().layers_of(FULL))
    result: dict = {}
    if "ttft" in args.parts:
        result["ttft"] = ttft_tiers(args.model, args.prompt_tokens, args.reps, vocab)
        t = result["ttft"]
        print(f"TTFT of {args.prompt_tokens} tokens: cold {t['cold']:.3f} s, device "
              f"{t['device']:.3f} s, host {t['host']:.3f} s, disk after a restart "
              f"{t['disk']:.3f} s (disk/host {t['disk'] / t['host']:.2f}x, disk/cold "
              f"{t['disk'] / t['cold']:.3f}x); disk with the page cache dropped "
              f"{t['disk_uncached']:.3f} s", flush=True)
    if "workload" in args.parts:
        host_blocks = args.device_blocks  # as large as the device cache
        host_gb = host_blocks * block_bytes / (1 << 30)
        working_set = args.conversations * args.context // BLOCK
        result["working_set_ratio"] = working_set / (args.device_blocks + host_blocks)
        for disk_tier in (False, True):
            name = "with_disk" if disk_tier else "without_disk"
            result[name] = workload(args.model, disk_tier, args.conversations, args.context,
                                    args.requests, args.device_blocks, host_gb, vocab)
            w = result[name]
            print(f"{name}: hit rate {w['hit_rate']:.1%}, TTFT p50 {w['ttft_p50']:.3f} s, "
                  f"p99 {w['ttft_p99']:.3f} s (working set {result['working_set_ratio']:.1f}x "
                  f"device + host)", flush=True)
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
