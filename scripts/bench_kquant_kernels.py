"""The K-quant kernels alone, on a GGUF file's own tensors (issue 54's kernel figures).

    .venv/bin/python scripts/bench_kquant_kernels.py /tmp/models/1b/Q4_K_M.gguf decode
    .venv/bin/python scripts/bench_kquant_kernels.py /tmp/models/1b/Q4_K_M.gguf prefill --rows 256
    .venv/bin/python scripts/bench_kquant_kernels.py /tmp/models/1b/Q4_K_M.gguf stack

* decode: every K-quant linear of the decoder layers once (one token's weight reads), at 1-4,
  8 and 16 rows through `kquant_linear` (the streaming kernel on the blocks) and, where built
  with AVX512-VNNI, `kquant_lanes_linear` (the lanes copy): best of 5 passes, ms and GB/s of
  weight bytes;
* prefill: the first two layers' linears at `--rows` rows through `kquant_dequant_linear` (bf16
  slabs + oneDNN) and, with AVX512-VNNI, `kquant_linear` (the integer GEMM, strips packed per
  call) and `kquant_lanes_linear` (the lanes copy), alternated: best of 4 each, GFLOPS;
* stack: a batch-1 decode step (`ModelRunner.all_logits`, 128-token prompt) with and without the
  one-call decode layer, alternated step by step in one process: medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch


def kquant_weights(path: str) -> list[tuple[str, torch.Tensor, int, int]]:
    from deepinfer.engine.model_store.gguf_index import read_index

    out = []
    for t in read_index(path).tensors:
        if t.name.startswith("blk.") and t.tensor_type.value in (12, 13, 14) and len(t.shape) == 2:
            out.append((t.name, torch.from_numpy(t.data), t.tensor_type.value, int(t.shape[0])))
    return out


def best_seconds(repeats: int, run) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def with_lanes(ws: list) -> list:
    """ws with each weight's lanes copy (None where it has none)."""
    from deepinfer.kernels.cpu import kquant_linear as kq

    return [(name, b, ty, k, kq.kquant_pack_lanes(b, ty, k)) for name, b, ty, k in ws]


def best_alternated(paths: dict, repeats: int) -> dict[str, float]:
    """Each path's best seconds of `repeats` runs, the paths taking turns."""
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(repeats):
        for name, run in paths.items():
            best[name] = min(best[name], best_seconds(1, run))
    return best


def decode(path: str) -> None:
    from deepinfer.kernels.cpu import kquant_linear as kq

    ws = with_lanes(kquant_weights(path))
    nbytes = sum(b.numel() for _, b, *_ in ws)
    lanes = kq.int8_gemm() and all(lane is not None for *_, lane in ws)
    for m in (1, 2, 3, 4, 8, 16):
        xs = {k: torch.randn(m, k) for _, _, _, k, _ in ws}
        paths = {"streaming": lambda xs=xs: [kq.kquant_linear(xs[k], b, ty)
                                             for _, b, ty, k, _ in ws]}
        if lanes:
            paths["lanes"] = lambda xs=xs: [kq.kquant_lanes_linear(xs[k], lane, ty)
                                            for _, _, ty, k, lane in ws]
        for name, run in paths.items():
            best = best_seconds(5, run)
            print(f"{len(ws)} linears, {nbytes / 1e6:.0f} MB, {m} row(s), {name}: "
                  f"{best * 1e3:.1f} ms ({nbytes / best / 1e9:.1f} GB/s)")


def prefill(path: str, rows: int) -> None:
    from deepinfer.kernels.cpu import kquant_linear as kq

    ws = with_lanes([w for w in kquant_weights(path) if w[0].startswith(("blk.0.", "blk.1."))])
    flops = sum(2 * rows * k * b.shape[0] for _, b, _, k, _ in ws)
    xs = {k: torch.randn(rows, k) for _, _, _, k, _ in ws}
    paths = {"bf16 slabs": lambda: [kq.kquant_dequant_linear(xs[k], b, ty)
                                    for _, b, ty, k, _ in ws]}
    if kq.int8_gemm():
        paths["int8, packed per call"] = lambda: [kq.kquant_linear(xs[k], b, ty)
                                                  for _, b, ty, k, _ in ws]
        if all(lane is not None for *_, lane in ws):
            paths["int8, lanes copy"] = lambda: [kq.kquant_lanes_linear(xs[k], lane, ty)
                                                 for _, _, ty, k, lane in ws]
    for name, seconds in best_alternated(paths, 4).items():
        print(f"two layers at {rows} rows, {name}: {seconds * 1e3:.1f} ms "
              f"({flops / seconds / 1e9:.0f} GFLOPS)")


def stack(path: str, steps: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_decode_step import runner  # noqa: E402  (sibling script)

    from deepinfer.engine.model_store import prepare_gguf_model

    model = str(prepare_gguf_model(Path(path)))
    threads = torch.get_num_threads()
    runs = {"one-call decode layer": runner(model, None, threads),
            "Python layers": runner(model, None, threads, python_layers=True)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        for i in range(steps):
            for name, step in runs.items():
                start = time.perf_counter()
                step(i, 128 + i)
                times[name].append(time.perf_counter() - start)
    for name, t in times.items():
        print(f"{name:<22} {statistics.median(t[5:]) * 1e3:.2f} ms a step")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("mode", choices=["decode", "prefill", "stack"])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.mode == "decode":
        decode(args.gguf)
    elif args.mode == "prefill":
        prefill(args.gguf, args.rows)
    else:
        stack(args.gguf, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
