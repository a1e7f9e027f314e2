"""Prefix hits on a real hybrid sliding-window model (Gemma 3 270M by default): what a hit costs
in each SWA mode, and whether many interleaved chat sessions keep their hits.

* ttft - for each hit length H: a first request caches H tokens plus a suffix, then (all with
  max_tokens=1, greedy, best of --repeats):
    - cold: the second prompt with the prefix cache off;
    - window / exact, no snapshot: a second prompt with the same H-token prefix and a new suffix,
      in an engine that keeps snapshots only where prompts end (--swa-snapshot-interval 0): the
      hit at H has none, so the sliding windows are replayed (W tokens in window mode, sliding
      layers x W in exact mode);
    - between snapshots: the same in an engine with the default interval (a snapshot every W
      tokens of the first prompt): the hit replays from the nearest snapshot before H;
    - at a snapshot: the first prompt again: its hit ends where its prompt left a snapshot, so
      nothing is replayed.
  Each engine runs on its own, one after another.
* sessions - --sessions chat sessions, --turns turns each, served round-robin (turn t of every
  session, then turn t+1): each turn's prompt is the session so far (previous prompts and
  answers) plus --turn-tokens new tokens, answered with --answer-tokens tokens. Reports the
  prefix-cache hit rate over turns 2.. (cached / prompt tokens), the hits that resumed from a
  snapshot and the replayed tokens, with a KV cache of --session-kv-blocks blocks.

    .venv/bin/python scripts/bench_swa_prefix.py --result-file swa.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from deepinfer import LLM, SamplingParams
from deepinfer.engine.model_store import ensure_model

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def best_ttft(llm: LLM, prompt, repeats: int) -> float:
    """Best time to one token; `prompt` is a list, or a function of the repeat giving one (a
    fresh prompt each time, so that no repeat hits what an earlier one cached)."""
    best = float("inf")
    for i in range(repeats):
        ids = prompt(i) if callable(prompt) else prompt
        t0 = time.perf_counter()
        llm.generate([ids], ONE)
        best = min(best, time.perf_counter() - t0)
    return best


def ttft_rows(args: argparse.Namespace, model: str) -> list[dict]:
    lengths = [int(x) for x in args.lengths.split(",")]
    rng = np.random.default_rng(args.seed)
    prompts = {}
    for h in lengths:
        prefix = rng.integers(10, 200000, h).tolist()
        # Suffixes longer than a block: the first prompt's last snapshot lies past H, so a
        # second prompt's hit at H does not land on it; each repeat has a new second prompt.
        seconds = [prefix + rng.integers(10, 200000, 24).tolist() for _ in range(args.repeats)]
        prompts[h] = (prefix + rng.integers(10, 200000, 24).tolist(), seconds)
    common = dict(max_model_len=max(lengths) + 64, max_num_batched_tokens=2048,
                  prefill_chunk_size=2048, block_size=16)
    rows = {h: {"prefix_tokens": h} for h in lengths}
    with LLM(model, enable_prefix_caching=False, **common) as cold:
        best_ttft(cold, prompts[lengths[0]][0][:64], 1)  # warm-up
        for h in lengths:
            rows[h]["cold_ms"] = best_ttft(cold, prompts[h][1].__getitem__, args.repeats) * 1e3
    engines = {  # name: engine settings
        "window": dict(swa_replay="window", swa_snapshot_interval=0),
        "exact": dict(swa_replay="exact", swa_snapshot_interval=0),
        "between": dict(swa_replay="window"),  # the default interval: W
    }
    for name, settings in engines.items():
        with LLM(model, **settings, **common) as llm:
            best_ttft(llm, prompts[lengths[0]][0][:64], 1)
            for h in lengths:
                first, seconds = prompts[h]
                llm.generate([first], ONE)  # caches the prefix (and snapshots)
                stats0 = llm.stats()
                ms = best_ttft(llm, seconds.__getitem__, args.repeats) * 1e3
                stats1 = llm.stats()
                rows[h][f"{name}_ms"] = ms
                rows[h][f"{name}_replayed_tokens"] = ((stats1.replayed_tokens
                                                       - stats0.replayed_tokens) // args.repeats)
                rows[h][f"{name}_snapshot_hits"] = (stats1.swa_snapshot_hits
                                                    - stats0.swa_snapshot_hits)
                if name == "between":
                    rows[h]["snapshot_ms"] = best_ttft(llm, first, args.repeats) * 1e3
                    stats2 = llm.stats()
                    rows[h]["snapshot_replayed_tokens"] = (stats2.replayed_tokens
                                                           - stats1.replayed_tokens)
    return [rows[h] for h in lengths]


def sessions(args: argparse.Namespace, model: str, kv_blocks: int) -> dict:
    rng = np.random.default_rng(args.seed + 1)
    history = [rng.integers(10, 200000, args.turn_tokens).tolist() for _ in range(args.sessions)]
    answer = SamplingParams(max_tokens=args.answer_tokens, temperature=0.0, ignore_eos=True)
    reusable = [0] * args.sessions
    prompt_tokens = cached = best = 0
    with LLM(model, num_kv_blocks=kv_blocks, block_size=16,
             max_model_len=args.turns * (args.turn_tokens + args.answer_tokens) + 64) as llm:
        for turn in range(args.turns):
            if turn == 1:
                base = llm.stats()
            for s in range(args.sessions):  # round-robin: every session's turn in turn
                out = llm.generate([history[s]], answer)[0]
                if turn >= 1:
                    prompt_tokens += len(history[s])
                    cached += out.cached_tokens
                    best += reusable[s]
                # What the next turn could at most find cached: whole blocks of this turn's
                # prompt and answer, its last token excepted.
                reusable[s] = (len(history[s]) + len(out.token_ids) - 1) // 16 * 16
                history[s] = (history[s] + out.token_ids
                              + rng.integers(10, 200000, args.turn_tokens).tolist())
        end = llm.stats()
    return {"sessions": args.sessions, "turns": args.turns, "kv_blocks": kv_blocks,
            "hit_rate_turns_2_on": cached / prompt_tokens,
            "best_possible_hit_rate": best / prompt_tokens,
            "snapshot_hits": end.swa_snapshot_hits - base.swa_snapshot_hits,
            "hits_possible": args.sessions * (args.turns - 1),
            "replayed_tokens": end.replayed_tokens - base.replayed_tokens,
            "evicted_blocks": end.prefix_cache_evictions - base.prefix_cache_evictions}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--lengths", default="1280,2304,4352",
                   help="hit lengths: ~1k, 2k, 4k, half a window (256) past a snapshot")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--turn-tokens", type=int, default=96)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--session-kv-blocks", default="400,1200",
                   help="KV cache sizes (blocks of 16 tokens per layer group) to run the "
                        "sessions workload with: one too small for every session, one not")
    p.add_argument("--workloads", default="ttft,sessions")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", default=None)
    args = p.parse_args(argv)
    model = ensure_model(args.model)
    result: dict = {"command": " ".join(["scripts/bench_swa_prefix.py",
                                         *(argv if argv is not None else sys.argv[1:])])}
    if "ttft" in args.workloads:
        result["ttft"] = ttft_rows(args, model)
        cols = ["window", "exact", "between", "snapshot"]
        print(f"{'H':>6} {'cold':>8} " + " ".join(f"{c:>9} {'(repl)':>7}" for c in cols)
              + "   TTFT ms, replayed tokens")
        for r in result["ttft"]:
            print(f"{r['prefix_tokens']:>6} {r['cold_ms']:>8.0f} " + " ".join(
                f"{r[c + '_ms']:>9.0f} {r[c + '_replayed_tokens']:>7}" for c in cols))
    if "sessions" in args.workloads:
        result["sessions"] = [sessions(args, model, int(n))
                              for n in args.session_kv_blocks.split(",")]
        for row in result["sessions"]:
            print(json.dumps(row))
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
