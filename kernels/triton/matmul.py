"""A row-invariant linear for --deterministic on a GPU: y = x @ w^T (+ bias), each output row
computed the same way whatever the number of rows.

cuBLAS picks its tiling, split-K and kernel by M, so a row's float sums change with the batch it
came in. Here one tile shape serves every M (no autotuning, no split-K): each program owns a
[BLOCK_M, BLOCK_N] tile of y and walks K in BLOCK_K steps from 0, accumulating in float32, so
an output's sum runs over K in one fixed order (the dot of each BLOCK_K step, then the steps in
order) wherever its row sits and however many rows there are. float32 inputs multiply in IEEE
float32 (no TF32 rounding); half inputs accumulate in float32 and round once at the end.
Slower than cuBLAS at large M (no tuning per shape): the price of the guarantee.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["linear_rows", "linear_rows_ref"]

BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 32  # one shape for every M: the invariance depends on it


@triton.jit
def _linear_rows_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, x_row, w_row, y_row,
                        HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * x_row + k[None, :],
                    mask=(rows < M)[:, None] & (k < K)[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None] * w_row + k[None, :],
                    mask=(cols < N)[:, None] & (k < K)[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * y_row + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows < M)[:, None] & (cols < N)[None, :])


def linear_rows(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
    """x [..., K], w [N, K] (rows contiguous), bias [N] or None -> [..., N] in x's dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    assert w.stride(-1) == 1 and w.shape[1] == k
    m, n = x2.shape[0], w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        _linear_rows_kernel[grid](
            x2, w, w if bias is None else bias, y, m, n, k, x2.stride(0), w.stride(0),
            y.stride(0), HAS_BIAS=bias is not None,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return y.view(*lead, n)


def linear_rows_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
                    ) -> torch.Tensor:
    y = x.float() @ w.float().t()
    return (y if bias is None else y + bias.float()).to(x.dtype)
