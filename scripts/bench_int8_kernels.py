"""The int8 linear kernels alone, on a GGUF Q8_0 file's own tensors (issue 54's Q8_0 figures).

    .venv/bin/python scripts/bench_int8_kernels.py /tmp/models/1b/Q8_0.gguf

Every linear of the decoder layers once (one token's weight reads), as the server holds them
(QuantizedMatmul with the integer GEMM's tiles kept):

* served: through QuantizedMatmul (`quant_linear` picks the kernel by the rows) at 1-4, 8, 16
  and 256 rows: best of 5, ms, GB/s of the int8 bytes, GOPS;
* 1-6 rows: the small-M kernel on the int8 rows and the integer GEMM on the tiles, alternated
  (best of 6 each): where one overtakes the other.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def matmuls(path: str) -> list:
    from deepinfer.workers.quantization.gguf import gguf_weights
    from deepinfer.workers.quantization.matmul import QuantizedMatmul
    from deepinfer.workers.quantization.weight import QuantizedWeight

    return [QuantizedMatmul(w, None) for name, w in gguf_weights(path)
            if isinstance(w, QuantizedWeight) and name.startswith("model.layers.")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_kquant_kernels import best_alternated, best_seconds  # noqa: E402  (sibling)

    from deepinfer.kernels.cpu import quant_linear as native

    ms = matmuls(args.gguf)
    nbytes = sum(m.weight.qweight.numel() for m in ms)
    print(f"{len(ms)} linears, {nbytes / 1e6:.0f} MB of int8, tiles kept: "
          f"{all(m.tiles is not None for m in ms)}")
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 8, 16, 256):
            xs = {m.weight.shape[1]: torch.randn(rows, m.weight.shape[1]) for m in ms}
            best = best_seconds(5, lambda xs=xs: [m(xs[m.weight.shape[1]]) for m in ms])
            print(f"served, {rows} row(s): {best * 1e3:.1f} ms ({nbytes / best / 1e9:.1f} GB/s, "
                  f"{2 * rows * nbytes / best / 1e9:.0f} GOPS)")
        for rows in range(1, 7):
            xs = {m.weight.shape[1]: torch.randn(rows, m.weight.shape[1]) for m in ms}
            best = best_alternated({
                "small-M": lambda xs=xs: [native.quant_linear_small_m(
                    xs[m.weight.shape[1]], m.weight.qweight, m.weight.scales) for m in ms],
                "integer GEMM": lambda xs=xs: [native.quant_linear_int_gemm(
                    xs[m.weight.shape[1]], m.weight.qweight, m.weight.scales, None, None,
                    m.tiles) for m in ms],
            }, 6)
            print(f"{rows} row(s): " + ", ".join(f"{name} {t * 1e3:.1f} ms"
                                                 for name, t in best.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
