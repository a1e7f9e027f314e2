"""Grouped LoRA products of multi-adapter serving: each row of a batch with its own adapter.

Same contract as kernels/cpu/lora.lora_delta_ (whose torch reference is reused): in place on
the base linear's output y [N, OUT], for each row i with s = slots[i] >= 0,

    t = a[s] @ x[i]  (float32 [P*R]),   y[i, off_p:off_p+SIZE_p] += bs[p][s] @ t[p*R:(p+1)*R]

Two kernels, both a grid over (rows, tiles) in which each program reads its row's slot and
returns at once for -1: the shrink writes t [N, P*R] in float32 (a tile of A's rows against
x[i], IN walked in blocks); the expand, launched once per part, adds a tile of that part's
outputs into y (one rounding to y's dtype). Rows are matrix-vector products against their own
adapter's weights, which is what decode batches are; weights of one slot are shared through
the cache by the rows that use it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from deepinfer.kernels.cpu.lora import lora_delta_reference

__all__ = ["lora_delta_", "lora_delta_reference"]


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, slots_ptr, t_ptr, in_features, pr, x_row,
                        BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:  # no adapter: t's row is never read
        return
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    j_mask = j < pr
    a_rows = a_ptr + slot * pr * in_features + j[:, None] * in_features
    acc = tl.zeros([BLOCK_J], tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < in_features
        xv = tl.load(x_ptr + row * x_row + k, mask=k_mask, other=0.0).to(tl.float32)
        av = tl.load(a_rows + k[None, :], mask=j_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.sum(av.to(tl.float32) * xv[None, :], axis=1)
    tl.store(t_ptr + row * pr + j, acc, mask=j_mask)


@triton.jit
def _lora_expand_kernel(t_ptr, b_ptr, slots_ptr, y_ptr, size, rank, pr, t_col, y_row, y_col,
                        BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:  # no adapter: y's row untouched
        return
    o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    o_mask = o < size
    r = tl.arange(0, BLOCK_R)
    r_mask = r < rank
    tv = tl.load(t_ptr + row * pr + t_col + r, mask=r_mask, other=0.0)
    bv = tl.load(b_ptr + slot * size * rank + o[:, None] * rank + r[None, :],
                 mask=o_mask[:, None] & r_mask[None, :], other=0.0)
    delta = tl.sum(bv.to(tl.float32) * tv[None, :], axis=1)
    y_ptrs = y_ptr + row * y_row + y_col + o
    yv = tl.load(y_ptrs, mask=o_mask, other=0.0)
    tl.store(y_ptrs, (yv.to(tl.float32) + delta).to(yv.dtype), mask=o_mask)


def lora_delta_(y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor,
                bs: Sequence[torch.Tensor], offsets: Sequence[int], block_j: int = 32,
                block_k: int = 128, block_o: int = 64) -> None:
    """y[i, off_p:off_p+SIZE_p] += bs[p][s] @ (a[s] @ x[i])[p*R:(p+1)*R] for s = slots[i] >= 0,
    in place. x [N, IN], y [N, OUT] with contiguous rows (row strides free), a [S, P*R, IN] and
    bs[p] [S, SIZE_p, R] contiguous, slots [N] integer; all on one device."""
    n, in_features = x.shape
    if n == 0:
        return
    assert x.stride(1) == 1 and y.stride(1) == 1, "x and y rows must be contiguous"
    assert a.is_contiguous() and all(b.is_contiguous() for b in bs)
    assert len(bs) == len(offsets) and a.shape[1] % len(bs) == 0
    pr = a.shape[1]
    rank = pr // len(bs)
    t = torch.empty(n, pr, dtype=torch.float32, device=x.device)
    block_j = min(block_j, triton.next_power_of_2(pr))
    _lora_shrink_kernel[(n, triton.cdiv(pr, block_j))](
        x, a, slots, t, in_features, pr, x.stride(0), BLOCK_J=block_j,
        BLOCK_K=min(block_k, triton.next_power_of_2(in_features)))
    for p, (b, off) in enumerate(zip(bs, offsets)):
        size = b.shape[1]
        assert b.shape[2] == rank and 0 <= off and off + size <= y.shape[1]
        block = min(block_o, triton.next_power_of_2(size))
        _lora_expand_kernel[(n, triton.cdiv(size, block))](
            t, b, slots, y, size, rank, pr, p * rank, y.stride(0), off, BLOCK_O=block,
            BLOCK_R=triton.next_power_of_2(rank))
