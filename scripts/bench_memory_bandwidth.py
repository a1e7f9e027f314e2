"""The machine's memory bandwidth, the physical limit of a batch-1 decode step: STREAM-style
copy, triad and read-only loops over buffers far larger than the caches, on `--threads` threads.

    .venv/bin/python scripts/bench_memory_bandwidth.py [--gib 1] [--threads 2] [--repeats 10]

A decode step reads every weight byte once and writes almost nothing, so a read loop is the
figure to hold it against: "read" (torch's sum over the buffer) and "gemv" (DeepInfer's bf16
decode kernel over a bf16 matrix of the same bytes, one row of activations: the loads of a
batch-1 step with almost no arithmetic, where that kernel is built); copy and triad count bytes
read plus written, as STREAM does (a write also reads its line first, so the memory moves more
than they count). Prints GB/s (10^9 bytes) per loop: the best of `--repeats`, and the median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch


def bandwidth(gib: float, threads: int, repeats: int) -> dict[str, dict[str, float]]:
    torch.set_num_threads(threads)
    n = int(gib * 2**30) // 4
    a, b, c = torch.ones(n), torch.full((n,), 2.0), torch.empty(n)
    loops: dict[str, tuple[Callable[[], object], int]] = {
        "read": (lambda: a.sum(), 4 * n),
        "copy": (lambda: c.copy_(a), 8 * n),
        "triad": (lambda: torch.add(b, a, alpha=3.0, out=c), 12 * n),
    }
    from deepinfer.kernels.cpu import bf16_linear

    if bf16_linear.available():
        w = torch.ones(n // 2048 * 2, 2048, dtype=torch.bfloat16)  # the buffer's bytes
        x = torch.ones(1, 2048)
        loops["gemv"] = (lambda: bf16_linear.bf16_linear_small_m(x, w), w.numel() * 2)
    out = {}
    for name, (fn, nbytes) in loops.items():
        fn()  # touch the pages once
        rates = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
        out[name] = {"best_gbps": max(rates), "median_gbps": statistics.median(rates)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="each buffer's size")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", action="store_true", help="print one JSON line instead")
    args = ap.parse_args()
    result = bandwidth(args.gib, args.threads, args.repeats)
    if args.json:
        print(json.dumps({"threads": args.threads, **result}))
        return
    for name, r in result.items():
        print(f"{name:>6}: best {r['best_gbps']:.1f} GB/s, median {r['median_gbps']:.1f} GB/s "
              f"({args.threads} threads, {args.gib:g} GiB buffers)")


if __name__ == "__main__":
    main()
