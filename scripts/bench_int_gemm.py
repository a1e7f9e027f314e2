"""The default model's 120 layer linears at M rows: the integer GEMM, dequantized tiles, oneDNN.

Kernel level, one process, the four alternating (this VM drifts from minute to minute):

* int GEMM   - `quant_linear_int_gemm`, int8 weights per output channel (random, the model's
               shapes), activations int8 per block of 32, the weight pre-packed once
               (`quant_linear_pack`, as the engine keeps it); "per call": packed every call
* 4-bit GEMM - the same kernel on 4-bit weights in groups of 32 with scales and mins (Q4_1's
               layout, as the shipped GGUF serves), pre-packed
* dequant    - `quant_linear_dequant`, the same weights through dequantized tiles + float32 GEMM
* oneDNN     - float32 weights packed for oneDNN, what the float32 model runs

    .venv/bin/python scripts/bench_int_gemm.py --rows 64 256
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from deepinfer.kernels.cpu import quant_linear as ql

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # SmolLM2-135M's layers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not ql.available(torch.empty(1)):
        print(f"native kernels unavailable: {ql.build_error()}")
        return 1
    gen = torch.Generator().manual_seed(0)
    int8 = [(torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8),
             torch.rand(n, 1, generator=gen) * 0.01) for n, k in SHAPES]
    q4 = [(torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8),
           torch.rand(n, k // 32, generator=gen) * 0.01,
           torch.rand(n, k // 32, generator=gen) * 0.01) for n, k in SHAPES]
    packed = [torch.ops.mkldnn._reorder_linear_weight(q.float() * s, 64) for q, s in int8]
    tiles8 = [ql.quant_linear_pack(q, s) for q, s in int8]
    tiles4 = [ql.quant_linear_pack(q, s, m) for q, s, m in q4]
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
        runs = {
            "int GEMM": lambda xs=xs: [ql.quant_linear_int_gemm(xs[q.shape[1]], q, s, None, None, t)
                                       for (q, s), t in zip(int8, tiles8)],
            "per call": lambda xs=xs: [ql.quant_linear_int_gemm(xs[q.shape[1]], q, s)
                                       for q, s in int8],
            "4-bit GEMM": lambda xs=xs: [ql.quant_linear_int_gemm(xs[2 * q.shape[1]], q, s, m,
                                                                  None, t)
                                         for (q, s, m), t in zip(q4, tiles4)],
            "dequant": lambda xs=xs: [ql.quant_linear_dequant(xs[q.shape[1]], q, s)
                                      for q, s in int8],
            "oneDNN": lambda xs=xs: [torch.ops.mkldnn._linear_pointwise(
                xs[k], w, None, "none", [], "") for w, (_, k) in zip(packed, SHAPES)],
        }
        times: dict[str, list[float]] = {name: [] for name in runs}
        for run in runs.values():
            run()  # warm up
        for _ in range(args.rounds):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"{rows} rows: " + ", ".join(f"{name} {v:.1f} ms" for name, v in ms.items())
              + f"; oneDNN / int GEMM {ms['oneDNN'] / ms['int GEMM']:.2f}x"
              + f", oneDNN / 4-bit GEMM {ms['oneDNN'] / ms['4-bit GEMM']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
