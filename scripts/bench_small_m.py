"""The default model's decode linears at 1, 2 and 4 rows: `quant_linear_small_m` per layout.

Kernel level, one process: the 120 layer linears of SmolLM2-135M and its 49152-row head (random
weights, 135 MB in int8: they stream from memory, as in a decode step), three layouts:

* int8   - per output channel (`--quantization int8`)
* Q8_0   - int8 in blocks of 32 with float16 scales (a Q8_0 GGUF)
* Q4_1   - 4-bit in groups of 32 with float16 scales and mins (the shipped GGUF)

`--against OLD.cpp` also builds another version of kernels/cpu/csrc/quant_linear.cpp (under its
own op namespace) and alternates the two call by call: this VM drifts by 10-30 % between
processes, more than most kernel changes are worth, so a change is judged within one process.

    .venv/bin/python scripts/bench_small_m.py [--against /tmp/quant_linear_before.cpp]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # for scripts.*, after site-packages

from deepinfer.kernels.cpu import quant_linear as ql  # noqa: E402
from scripts.bench_int_gemm import SHAPES as LAYERS  # noqa: E402

SHAPES = LAYERS + [(49152, 576)]  # the layers' linears and the head


def weights(layout: str, gen: torch.Generator) -> list[tuple]:
    out = []
    for n, k in SHAPES:
        if layout == "Q4_1":
            out.append((torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8),
                        (torch.rand(n, k // 32, generator=gen) * 0.01).half(),
                        (torch.rand(n, k // 32, generator=gen) * 0.01).half()))
            continue
        q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        groups = 1 if layout == "int8" else k // 32
        scales = torch.rand(n, groups, generator=gen) * 0.01
        out.append((q, scales if layout == "int8" else scales.half(), None))
    return out


def build_against(path: Path):
    """The other version's quant_linear_small_m, built under a namespace of its own."""
    from torch.utils.cpp_extension import load

    source = path.read_text()
    tag = hashlib.sha1(source.encode()).hexdigest()[:8]
    namespace = f"bench_small_m_{tag}"
    for macro in ("TORCH_LIBRARY_FRAGMENT", "TORCH_LIBRARY_IMPL"):
        source = source.replace(f"{macro}(deepinfer_cpu", f"{macro}({namespace}")
    build = Path(tempfile.gettempdir()) / namespace
    build.mkdir(exist_ok=True)
    (build / "quant_linear.cpp").write_text(source)
    load(name=namespace, sources=[str(build / "quant_linear.cpp")], build_directory=str(build),
         extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
         is_python_module=False)
    return getattr(torch.ops, namespace).quant_linear_small_m


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--layouts", nargs="+", default=["int8", "Q8_0", "Q4_1"])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--against", type=Path, help="another quant_linear.cpp to alternate with")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not ql.available(torch.empty(1)):
        print(f"native kernels unavailable: {ql.build_error()}")
        return 1
    kernels = {"this": ql.quant_linear_small_m}
    if args.against is not None:
        kernels["against"] = build_against(args.against)
    gen = torch.Generator().manual_seed(0)
    for layout in args.layouts:
        ws = weights(layout, gen)
        for rows in args.rows:
            xs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
            times: dict[str, list[float]] = {name: [] for name in kernels}
            for _ in range(args.rounds + 1):  # the first round warms up
                for name, kernel in kernels.items():
                    start = time.perf_counter()
                    for q, s, m in ws:
                        kernel(xs[q.shape[1] * (2 if layout == "Q4_1" else 1)], q, s, m)
                    times[name].append(time.perf_counter() - start)
            ms = {name: statistics.median(t[1:]) * 1e3 for name, t in times.items()}
            line = ", ".join(f"{name} {v:.2f} ms" for name, v in ms.items())
            if "against" in ms:
                line += f"; against / this {ms['against'] / ms['this']:.2f}x"
            print(f"{layout} {rows} row(s): {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
