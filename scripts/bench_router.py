"""Multi-turn chat through data-parallel replicas: what the router's placement policy saves.

For each policy, `deepinfer serve --data-parallel-size 2 --policy P` starts (the default model),
and --sessions chat sessions run --turns turns each: every session's turn t at once, then turn
t + 1. Each session has its own system prompt; each turn adds a user message to the session's
history (previous questions and answers) and streams a greedy answer of --answer-tokens tokens.
Reported over turns 2.. (the turns that could reuse a cached prefix): prompt tokens, of which
served from a prefix cache, the tokens computed, the hit rate, and time to first token.

    .venv/bin/python scripts/bench_router.py --result-file router.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))  # for scripts.*, after site-packages

from scripts.server_process import ServerProcess, free_ports  # noqa: E402

TOPICS = ["astronomy", "cooking", "gardening", "chess", "sailing", "baking", "painting",
          "cycling", "history", "music", "geology", "poetry"]


# "events": cache_aware placement on the replicas' KV events (exact) instead of the router's
# approximate index of what it sent where.
EVENTS = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:%d"}'


def start(policy: str, replicas: int, model: str, kv_blocks: int | None) -> ServerProcess:
    args = ["--data-parallel-size", str(replicas)]
    if policy == "events":
        args += ["--policy", "cache_aware", "--kv-events-config", EVENTS % free_ports(replicas)]
    else:
        args += ["--policy", policy]
    if kv_blocks is not None:
        args += ["--num-kv-blocks", str(kv_blocks)]
    return ServerProcess(model, *args, timeout=600)


async def turn(session: aiohttp.ClientSession, url: str, messages: list[dict],
               answer_tokens: int) -> dict:
    body = {"model": "default", "messages": messages, "max_tokens": answer_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    ttft = ttft or time.perf_counter() - t0
                    text.append(piece)
    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {"ttft": ttft or 0.0, "text": "".join(text), "prompt": usage["prompt_tokens"],
            "cached": cached}


async def workload(url: str, args: argparse.Namespace) -> dict:
    histories = [[{"role": "system", "content": f"You are an expert in {TOPICS[i % 12]}. "
                   + f"Answer questions about {TOPICS[i % 12]} in two short sentences. " * 12}]
                 for i in range(args.sessions)]
    rows = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        for t in range(args.turns):
            for h in histories:
                h.append({"role": "user", "content": f"Tell me fact number {t + 1} about it."})
            results = await asyncio.gather(*(turn(session, url, h, args.answer_tokens)
                                             for h in histories))
            for h, r in zip(histories, results):
                h.append({"role": "assistant", "content": r["text"]})
                if t:
                    rows.append(r)
    prompt = sum(r["prompt"] for r in rows)
    cached = sum(r["cached"] for r in rows)
    ttfts = sorted(r["ttft"] for r in rows)
    return {"prompt_tokens": prompt, "cached_tokens": cached, "computed_tokens": prompt - cached,
            "hit_rate": cached / prompt, "ttft_mean_ms": statistics.mean(ttfts) * 1e3,
            "ttft_p50_ms": statistics.median(ttfts) * 1e3,
            "ttft_p99_ms": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] * 1e3}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--policies", default="cache_aware,round_robin",
                   help="comma-separated: cache_aware, round_robin, least_load, or events "
                        "(cache_aware on the replicas' KV events)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="per replica (small: cache pressure, evictions)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--sessions", type=int, default=7, help="odd: round robin moves sessions")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--result-file", default=None)
    args = p.parse_args(argv)
    out = {"command": " ".join(["scripts/bench_router.py", *(argv or sys.argv[1:])])}
    for policy in args.policies.split(","):
        server = start(policy, args.replicas, args.model, args.num_kv_blocks)
        try:
            out[policy] = asyncio.run(workload(server.base_url, args))
        finally:
            server.stop()
        print(policy, json.dumps(out[policy]))
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
