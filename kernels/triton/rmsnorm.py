"""RMSNorm, optionally fused with the residual add, in one pass over each row.

Same contract as kernels/cpu/fused.add_rms_norm: with a residual, `residual += x` in place and
the norm is of the sum (the next layer reads the updated residual); statistics in float32, as
the HF reference computes them. One program per row: rows are at most a few thousand wide, so a
whole row fits in one block and is read once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.cpu.fused import add_rms_norm_ref

__all__ = ["add_rms_norm", "add_rms_norm_ref"]


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # Rounded to the storage dtype first, as the in-place torch add does.
        x = (x.to(tl.float32) + tl.load(res_ptr + row * n + cols, mask=mask, other=0.0)
             .to(tl.float32)).to(x.dtype)
        tl.store(res_ptr + row * n + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (x32 * rstd).to(x.dtype) * w
    tl.store(out_ptr + row * n + cols, y.to(x.dtype), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """RMSNorm(residual + x) * weight with residual += x in place; RMSNorm(x) * weight when
    residual is None. x, residual contiguous [..., n]; returns a new tensor shaped like x."""
    assert x.is_contiguous() and (residual is None or residual.is_contiguous())
    n = x.shape[-1]
    out = torch.empty_like(x)
    rows = x.numel() // n if n else 0
    if rows:
        _add_rms_norm_kernel[(rows,)](x, x if residual is None else residual, weight, out, n,
                                      eps, HAS_RESIDUAL=residual is not None,
                                      BLOCK=triton.next_power_of_2(n))
    return out
