"""Tensor parallelism: per-worker memory and throughput at TP=1 and TP=2 on one machine.

For each size: the engine starts (`LLM(model, tensor_parallel_size=N)`), warms up, and then
- batch-1 decode: one request, --output-len tokens, greedy, EOS ignored (tok/s after the first);
- N streams: --num-prompts random prompts of --input-len tokens at once, --output-len each
  (output tok/s over the whole run);
- each worker's resident memory (VmRSS from /proc) after the runs.

    .venv/bin/python scripts/bench_tp.py --result-file tp.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parent.parent))  # for scripts.*, after site-packages

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.engine.model_store import ensure_model  # noqa: E402
from scripts.server_process import descendants, rss_mb  # noqa: E402


def worker_rss_mb() -> list[float]:
    """Resident memory of this process's engine workers, rank order."""
    workers = sorted((name, pid) for pid, name in descendants(os.getpid()).items()
                     if name.startswith("worker"))
    return [rss_mb(pid) for _, pid in workers]


def measure(model: str, tp: int, args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 40000, args.input_len).tolist() for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    with LLM(model, tensor_parallel_size=tp) as llm:
        llm.generate([prompts[0][:16]], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
        first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([prompts[0]], first)
        t1 = time.perf_counter()
        llm.generate([prompts[0]], params)
        t2 = time.perf_counter()
        batch1 = (args.output_len - 1) / max(1e-9, (t2 - t1) - (t1 - t0))
        t3 = time.perf_counter()
        outs = llm.generate(prompts, params)
        streams = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t3)
        rss = worker_rss_mb()
    return {"tensor_parallel_size": tp, "batch1_decode_tok_s": batch1,
            "streams_output_tok_s": streams, "worker_rss_mb": rss}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--sizes", default="1,2")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--result-file", default=None)
    args = p.parse_args(argv)
    model = ensure_model(args.model)
    rows = [measure(model, int(n), args) for n in args.sizes.split(",")]
    for r in rows:
        print(json.dumps(r))
    if args.result_file:
        Path(args.result_file).write_text(json.dumps({
            "command": " ".join(["scripts/bench_tp.py", *(argv or sys.argv[1:])]),
            "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
