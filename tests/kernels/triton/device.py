"""Where the Triton kernel tests run: the GPU when there is one, else CPU through the interpreter.

TRITON_INTERPRET must be set before the kernels are decorated (when kernels.triton.* is first
imported); conftest.py imports this module, and pytest loads it before this folder's tests.
Triton reads the variable each time it decorates a kernel, so an earlier `import triton`
elsewhere (xgrammar imports it) does not matter.

`check` compares a kernel's output with its reference and keeps the worst error per kernel and
dtype, which conftest.py prints after the run (scripts/gpu_check.sh shows it as its summary).
"""

from __future__ import annotations

import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = "cuda" if ON_GPU else "cpu"
# Half precision only on the GPU: the interpreter runs it through numpy, slowly.
DTYPES = [torch.float32, torch.float16, torch.bfloat16] if ON_GPU else [torch.float32]
_TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}

# (kernel, dtype name) -> the worst max abs error seen, and the bound that case had
ERRORS: dict[tuple[str, str], tuple[float, float]] = {}


def tolerance(dtype: torch.dtype) -> float:
    return _TOL[dtype]


def scaled(dtype: torch.dtype, ref: torch.Tensor) -> float:
    """The dtype's bound scaled by the reference's magnitude (rounding error is relative)."""
    return tolerance(dtype) * max(1.0, ref.abs().max().item())


def max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs difference, treating matching infinities as equal."""
    out, ref = out.cpu().float(), ref.cpu().float()
    both_inf = torch.isinf(out) & torch.isinf(ref) & (out == ref)
    diff = (out - ref).abs().masked_fill(both_inf, 0.0)
    return diff.max().item() if diff.numel() else 0.0


def check(kernel: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> float:
    """Asserts max |out - ref| < tol (NaN fails) and records it under `kernel`."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    err = max_err(out, ref)
    key = (kernel, str(out.dtype).removeprefix("torch."))
    worst = ERRORS.get(key, (-1.0, tol))[0]
    if err != err or err >= worst:  # NaN, or the worst case so far (with its bound)
        ERRORS[key] = (err, tol)
    assert err < tol, f"{kernel}: max abs error {err:.3g} >= {tol:.3g}"
    return err
