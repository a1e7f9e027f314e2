"""Grouped LoRA products of multi-adapter serving on CPU: rows of one batch, each its own adapter.

The op, in place on the base linear's output y (the same contract as kernels/triton/lora.py):

    lora_delta_(y, x, slots, a, bs, offsets)
    x [N, IN], y [N, OUT] (same dtype), slots int32 [N] (-1: no adapter, row untouched),
    a [S, P*R, IN]: the P parts' A matrices of S adapter slots stacked along dim 1,
    bs[p] [S, SIZE_p, R]: part p's B matrix (scale folded in), added at y[:, offsets[p]:+SIZE_p].
    For each row i with s = slots[i] >= 0: t = a[s] @ x[i] (float32),
        y[i, off_p:off_p+SIZE_p] += bs[p][s] @ t[p*R:(p+1)*R]

A fused q|k|v linear has P=3 parts, gate|up P=2, o/down P=1; smaller ranks are zero-padded to R.
`lora_delta_` runs the native kernel (csrc/lora.cpp, built on first use like the other CPU
kernels) for float32 / bfloat16 / float16 CPU tensors, else `lora_delta_reference` in torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.kernels.cpu.native import NativeOp

_OP = NativeOp("lora", "lora.cpp", "lora_delta_")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def build_error() -> str | None:
    """Why the extension could not be built (None: built, or not tried yet)."""
    return _OP.error


def available(*tensors: torch.Tensor) -> bool:
    """True when the kernel is built (building it on first call) and takes these tensors:
    contiguous CPU tensors of one of its dtypes."""
    try:
        if not all(t.device.type == "cpu" and t.dtype in _DTYPES and t.is_contiguous()
                   for t in tensors):
            return False
    except AttributeError:  # not a tensor
        return False
    return _OP.load() is not None


def lora_delta_(y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor,
                bs: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """y[i, off_p:off_p+SIZE_p] += bs[p][s] @ (a[s] @ x[i])[p*R:(p+1)*R] for s = slots[i] >= 0,
    in place. The native kernel where it takes the tensors, else the torch reference."""
    if (x.dtype == y.dtype == a.dtype and all(b.dtype == x.dtype for b in bs)
            and available(y, x, a, *bs) and slots.device.type == "cpu"):
        _OP(y, x, slots.to(torch.int32).contiguous(), a, list(bs), [int(o) for o in offsets])
    else:
        lora_delta_reference(y, x, slots, a, bs, offsets)


def lora_delta_reference(y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor,
                         bs: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """The same op in plain torch, any device and dtype: rows grouped by slot, two matmuls per
    group in (at least) float32, each y element rounded once to y's dtype."""
    if x.shape[0] == 0:
        return
    acc = torch.promote_types(x.dtype, torch.float32)
    rank = a.shape[1] // len(bs)
    for s in torch.unique(slots).tolist():  # one host sync: the slots in use
        if s < 0:
            continue
        rows = (slots == s).nonzero().squeeze(1)
        t = x.index_select(0, rows).to(acc) @ a[s].to(acc).T  # [n, P*R]
        for p, (b, off) in enumerate(zip(bs, offsets)):
            cols = slice(off, off + b.shape[1])
            delta = t[:, p * rank:(p + 1) * rank] @ b[s].to(acc).T  # [n, SIZE_p]
            y[rows, cols] = (y[rows, cols].to(acc) + delta).to(y.dtype)
