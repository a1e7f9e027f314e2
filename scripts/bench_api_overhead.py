"""What the reasoning parser and the Anthropic endpoint cost against plain chat, streamed.

Two servers of the default model run side by side: a plain one, and one with
`--reasoning-parser deepseek_r1` (R1 reads every output as reasoning until `</think>`, so each
token goes through the parser). Three sides, each `--num-prompts` streamed requests at
`--concurrency` at once, greedy, the same prompts (so the same outputs, token for token):

* chat: `/v1/chat/completions` on the plain server (the peer);
* reasoning: `/v1/chat/completions` on the parser's server;
* messages: `/v1/messages` on the plain server.

EOS is not ignored (Anthropic's API has no such field): greedy answers are the same on every
side, so every side generates the same tokens. The sides alternate `--repeats` times; each
figure is the median output tok/s, reported as a ratio to chat's.

    .venv/bin/python scripts/bench_api_overhead.py                  # the full run
    .venv/bin/python scripts/bench_api_overhead.py --num-prompts 4 --repeats 1   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # for scripts.*, after site-packages

from deepinfer.frontend.bench.serving import add_arguments, benchmark  # noqa: E402
from scripts.server_process import ServerProcess  # noqa: E402

SIDES = {"chat": ("plain", "/v1/chat/completions"),
         "reasoning": ("reasoning", "/v1/chat/completions"),
         "messages": ("plain", "/v1/messages")}


def run_side(server: ServerProcess, endpoint: str, args: argparse.Namespace) -> dict:
    bench = argparse.ArgumentParser()
    add_arguments(bench)
    opts = bench.parse_args([
        "--base-url", server.base_url, "--endpoint", endpoint, "--no-ignore-eos",
        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--disable-tqdm"])
    return asyncio.run(benchmark(opts))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--result-file", default="api_overhead.json")
    args = p.parse_args()
    servers = {"plain": ServerProcess(args.model),
               "reasoning": ServerProcess(args.model, "--reasoning-parser", "deepseek_r1")}
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    try:
        for server, endpoint in SIDES.values():  # warm-up: compile, caches, pages
            run_side(servers[server], endpoint, argparse.Namespace(**{
                **vars(args), "num_prompts": args.concurrency}))
        for _ in range(args.repeats):
            for side, (server, endpoint) in SIDES.items():
                report = run_side(servers[server], endpoint, args)
                assert not report["errors"], report["errors"]
                runs[side].append(report)
    finally:
        for server in servers.values():
            server.stop()
    tok_s = {side: statistics.median(r["output_throughput"] for r in reports)
             for side, reports in runs.items()}
    tokens = {side: sum(reports[0]["output_lens"]) for side, reports in runs.items()}
    summary = {"output_tok_s": tok_s, "output_tokens": tokens,
               "ratio_to_chat": {side: tok_s[side] / tok_s["chat"] for side in SIDES},
               "args": vars(args)}
    Path(args.result_file).write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
