"""The bf16 decode kernels alone, on a bf16 safetensors checkpoint's layer weights (issue 54's
bf16 kernel figures): every linear of the decoder layers once (one token's weight reads) at 1,
4, 8 and 16 rows, through `bf16_linear_small_m` (the row-major weight) and `bf16_strips_linear`
(the strips copy), alternated: best of 5 passes, ms and GB/s of weight bytes.

    .venv/bin/python scripts/bench_bf16_kernels.py /tmp/models/1b/hf
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kquant_kernels import best_alternated  # noqa: E402  (a sibling script)


def layer_weights(model_dir: str) -> list[torch.Tensor]:
    from safetensors import safe_open

    out = []
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a dict)
                if ".layers." in name and name.endswith("proj.weight"):
                    out.append(f.get_tensor(name).to(torch.bfloat16).contiguous())
    return out


def main() -> int:
    from deepinfer.kernels.cpu import bf16_linear

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ws = [(w, bf16_linear.bf16_pack_strips(w)) for w in layer_weights(args.model_dir)]
    nbytes = sum(w.numel() * 2 for w, _ in ws)
    strips = all(s is not None for _, s in ws)
    for m in (1, 4, 8, 16):
        xs = {k: torch.randn(m, k) for k in {w.shape[1] for w, _ in ws}}
        paths = {"row-major": lambda xs=xs: [bf16_linear.bf16_linear_small_m(xs[w.shape[1]], w)
                                             for w, _ in ws]}
        if strips:
            paths["strips"] = lambda xs=xs: [bf16_linear.bf16_strips_linear(xs[w.shape[1]], s)
                                             for w, s in ws]
        for name, seconds in best_alternated(paths, 5).items():
            print(f"{len(ws)} linears, {nbytes / 1e6:.0f} MB, {m} row(s), {name}: "
                  f"{seconds * 1e3:.1f} ms ({nbytes / seconds / 1e9:.1f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
