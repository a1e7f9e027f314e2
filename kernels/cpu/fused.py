"""Fused float32 element-wise ops of a decoder layer on CPU, with their torch references.

In eager torch a norm, a rotary embedding or a gated activation is several ops, each a Python
dispatch and a pass over memory; at decode batch sizes they cost as much as the weights. The
native versions (csrc/fused_ops.cpp, built on first use like the other CPU kernels) do each in
one pass. The `*_ref` functions are the same maths in torch: the fallback where the native op
is unavailable (other devices and dtypes, no compiler) and the reference the tests hold the
native ops to.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from deepinfer.kernels.cpu.native import NativeOp

_OP = NativeOp("fused_ops", "fused_ops.cpp", "silu_and_mul")


@functools.cache
def _op(name: str):
    return _OP.sibling(name)  # resolved once: the lookup is on every layer's path


def build_error() -> str | None:
    """Why the extension could not be built (None: built, or not tried yet)."""
    return _OP.error


def available(*tensors: torch.Tensor | None) -> bool:
    """True when the ops are built (building them on first call) and take these tensors."""
    return _OP.available(*tensors)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """RMSNorm(residual + x) * weight, with residual += x in place; RMSNorm(x) * weight when
    residual is None. x, residual contiguous [..., n]."""
    return _op("add_rms_norm")(x, residual, weight, eps)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
    if residual is not None:
        x = residual.add_(x)
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()  # the HF reference computes the statistics in float32
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, positions: torch.Tensor,
                  k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                  slots: torch.Tensor | None = None) -> None:
    """Rotary embedding ("rotate half") in place on q [T, H, D] and k [T, KVH, D] (heads
    contiguous, rows may be strided views of a fused qkv output), cos/sin [max_pos, D] at
    int64 `positions` [T]; then k, v rows written to cache slots (`slots` [T] int64, -1: not
    written) of caches [num_blocks, block_size, KVH, D]: float32, or float16 / bfloat16 (rounded
    to nearest even as they are stored)."""
    _op("rope_store_kv")(q, k, v, cos, sin, positions, k_cache, v_cache, slots)


def rope_store_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, positions: torch.Tensor,
                      k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                      slots: torch.Tensor | None = None) -> None:
    c = cos[positions].unsqueeze(1).to(q.dtype)
    s = sin[positions].unsqueeze(1).to(q.dtype)
    for x in (q, k):
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        x.copy_(x * c + rotated * s)
    if k_cache is None:
        return
    rows = (slots >= 0).nonzero().squeeze(1)
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slots[rows], k[rows].to(k_cache.dtype))
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slots[rows], v[rows].to(v_cache.dtype))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for contiguous [..., 2n] rows laid out [gate | up] -> [..., n]."""
    return _OP(x)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
