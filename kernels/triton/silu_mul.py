"""silu(gate) * up for the fused gate/up projection's output, in one pass.

Rows are laid out [gate | up] (the fused linear's order), as in kernels/cpu/fused.silu_and_mul.
The activation is computed in float32 and rounded once to the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.cpu.fused import silu_and_mul_ref

__all__ = ["silu_and_mul", "silu_and_mul_ref"]


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * 2 * n + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * n + n + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * n + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Contiguous [..., 2n] rows -> [..., n]."""
    assert x.is_contiguous() and x.shape[-1] % 2 == 0
    n = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], n)
    rows = out.numel() // n if n else 0
    if rows:
        block = min(block, triton.next_power_of_2(n))
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](x, out, n, BLOCK=block)
    return out
