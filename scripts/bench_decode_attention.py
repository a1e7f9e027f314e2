"""A/B of native decode-attention kernel sources in one process (the machine is too noisy for
separate runs): each source is built under its own op namespace and timed in alternation.

    .venv/bin/python scripts/bench_decode_attention.py OLD.cpp kernels/cpu/csrc/paged_attention.cpp

KV_DTYPES=float32,float16 (an environment variable) times each source over caches of each of
those types (--kv-cache-dtype): default float32.

Each (batch, context) case: layers of random paged K/V (blocks scattered over the pool), every
kernel timed six times in turn over all layers; prints median and best ms per layer.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

CSRC = Path(__file__).resolve().parent.parent / "kernels" / "cpu" / "csrc"
CASES = ((64, 144, 30), (8, 4096, 8), (2, 16384, 4), (1, 256, 30))  # batch, context, layers


def build(index: int, source: str):
    """Compile `source` with its op namespace renamed, return its decode op."""
    namespace = f"bench_attn_{index}"
    text = Path(source).read_text().replace("deepinfer_cpu", namespace)
    copy = Path(tempfile.mkdtemp()) / f"{namespace}.cpp"
    copy.write_text(text)
    load(name=namespace, sources=[str(copy)], extra_cflags=["-O3", "-march=native", "-fopenmp"],
         extra_ldflags=["-fopenmp"], extra_include_paths=[str(CSRC)], is_python_module=False)
    return getattr(torch.ops, namespace).paged_decode_attention


def main(sources: list[str]) -> None:
    torch.set_num_threads(2)
    built = {src: build(i, src) for i, src in enumerate(sources)}
    dtypes = os.environ.get("KV_DTYPES", "float32").split(",")
    ops = {f"{Path(src).name} {d}" if len(dtypes) > 1 else Path(src).name: (op, getattr(torch, d))
           for src, op in built.items() for d in dtypes}
    block, kv_heads, dim, heads = 16, 3, 64, 9  # SmolLM2-135M's attention
    for batch, ctx, layers in CASES:
        per_row = ctx // block
        num_blocks = batch * per_row * max(1, 2048 // (batch * per_row)) + 16
        caches = {d: [] for d in {dtype for _, dtype in ops.values()}}
        for _ in range(layers):
            k, v = (torch.randn(num_blocks, block, kv_heads, dim) for _ in range(2))
            for d, layer_caches in caches.items():
                layer_caches.append((k.to(d), v.to(d)))
        tables = torch.stack([torch.randperm(num_blocks)[:per_row] for _ in range(batch)])
        lo = torch.zeros(batch, dtype=torch.int32)
        hi = torch.full((batch,), ctx, dtype=torch.int32)
        q = torch.randn(batch, heads, dim)
        times: dict[str, list[float]] = {name: [] for name in ops}
        for _ in range(6):
            for name, (op, dtype) in ops.items():
                start = time.perf_counter()
                for k, v in caches[dtype]:
                    op(q, k, v, tables, lo, hi, dim**-0.5)
                times[name].append((time.perf_counter() - start) / layers * 1e3)
        cells = [f"{name}: median {sorted(t)[len(t) // 2]:.3f} best {min(t):.3f} ms"
                 for name, t in times.items()]
        print(f"batch {batch} x context {ctx}: " + "  |  ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1:] or [str(CSRC / "paged_attention.cpp")])
