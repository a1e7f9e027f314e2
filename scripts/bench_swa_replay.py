"""Prefix-hit cost on a hybrid sliding-window model, as the cached prefix H grows.

Builds a random hybrid Qwen3 (full and sliding layers, window W), then for each H: a first
request caches a prefix of H tokens, a second request with the same prefix and a new suffix
measures the time to its first token (max_tokens=1) and the tokens replayed for the sliding
windows. With SWA bounded replay both stay flat in H; a cold run (no prefix cache) grows with H.

    python scripts/bench_swa_replay.py [--window 128] [--lengths 512,1024,2048,4096]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parent.parent))  # for scripts.*, after site-packages

from deepinfer import LLM, SamplingParams  # noqa: E402
from scripts.tiny_models import save_tiny_model  # noqa: E402

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def build_model(out: Path, window: int, max_len: int) -> Path:
    kinds = ["sliding_attention"] * 3 + ["full_attention"]
    return save_tiny_model(out, "qwen3", hidden_size=256, intermediate_size=768,
                           num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                           head_dim=32, sliding_window=window, use_sliding_window=True,
                           layer_types=kinds * 2, max_position_embeddings=max_len)


def timed(llm: LLM, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    llm.generate([prompt], ONE)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument("--result-file", default=None)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "hybrid", args.window, max(lengths) + 256)
        common = dict(num_kv_blocks=4 * (max(lengths) // 16 + 64), block_size=16,
                      max_num_batched_tokens=2048, prefill_chunk_size=2048)
        with LLM(str(model), **common) as cached, \
                LLM(str(model), enable_prefix_caching=False, **common) as cold:
            timed(cached, rng.integers(3, 40000, 64).tolist())  # warm-up
            timed(cold, rng.integers(3, 40000, 64).tolist())
            for h in lengths:
                prefix = rng.integers(3, 40000, h).tolist()
                timed(cached, prefix + rng.integers(3, 40000, 8).tolist())
                before = cached.stats().replayed_tokens
                second = prefix + rng.integers(3, 40000, 8).tolist()
                hit_s = timed(cached, second)
                replayed = cached.stats().replayed_tokens - before
                cold_s = timed(cold, second)
                rows.append(dict(prefix_tokens=h, window=args.window, replayed_tokens=replayed,
                                 hit_ttft_ms=round(hit_s * 1e3, 1),
                                 cold_ttft_ms=round(cold_s * 1e3, 1)))
                print(json.dumps(rows[-1]), flush=True)
    print(f"{'H':>6} {'replayed':>9} {'hit TTFT ms':>12} {'cold TTFT ms':>13}")
    for r in rows:
        print(f"{r['prefix_tokens']:>6} {r['replayed_tokens']:>9} {r['hit_ttft_ms']:>12} "
              f"{r['cold_ttft_ms']:>13}")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(dict(command=sys.argv, rows=rows), indent=1))


if __name__ == "__main__":
    main()
