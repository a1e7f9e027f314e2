"""Rotary embedding on q and k, then k and v stored into the paged KV cache, in one launch.

Same contract as kernels/cpu/fused.rope_store_kv: "rotate half" (neox) rotary, out =
x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1], applied in place to q [T, H, D]
and k [T, KVH, D] (rows may be strided views of a fused qkv output; heads contiguous), with
cos/sin tables [max_pos, D] read at `positions`; then the rotated k and v rows are written to
cache slots (slot = block * block_size + offset; -1: not written, e.g. replayed tokens whose
K/V a full-attention layer already holds). One program per token does all of its heads, so the
stored k is exactly the rotated one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.cpu.fused import rope_store_kv_ref

__all__ = ["rope_store_kv", "rope_store_kv_ref"]


@triton.jit
def _rotate(x_ptr, row_stride, head_stride, heads, c1, c2, s1, s2, t, half,
            BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotates one token's heads in place; returns the rotated halves [BLOCK_H, BLOCK_HALF]."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < heads) & (d < half)
    p1 = x_ptr + t * row_stride + h * head_stride + d
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + half, mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * c1 - x2 * s1
    y2 = x2 * c2 + x1 * s2
    tl.store(p1, y1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + half, y2.to(x_ptr.dtype.element_ty), mask=mask)
    return y1, y2


@triton.jit
def _rope_store_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr,
                          slot_ptr, q_row, q_head, k_row, k_head, v_row, v_head, table_row,
                          c_block, c_slot, c_head, block_size, heads, kv_heads, half,
                          STORE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr,
                          BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    dm = d < half
    c1 = tl.load(cos_ptr + pos * table_row + d, mask=dm, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * table_row + half + d, mask=dm, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * table_row + d, mask=dm, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * table_row + half + d, mask=dm, other=0.0).to(tl.float32)
    _rotate(q_ptr, q_row, q_head, heads, c1, c2, s1, s2, t, half, BLOCK_H, BLOCK_HALF)
    k1, k2 = _rotate(k_ptr, k_row, k_head, kv_heads, c1, c2, s1, s2, t, half, BLOCK_KVH,
                     BLOCK_HALF)
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        h = tl.arange(0, BLOCK_KVH)[:, None]
        mask = (h < kv_heads) & dm & ((h * 0 + slot) >= 0)  # slot -1: not written
        dst = (slot // block_size) * c_block + (slot % block_size) * c_slot + h * c_head + d
        cdt = kc_ptr.dtype.element_ty
        tl.store(kc_ptr + dst, k1.to(k_ptr.dtype.element_ty).to(cdt), mask=mask)
        tl.store(kc_ptr + dst + half, k2.to(k_ptr.dtype.element_ty).to(cdt), mask=mask)
        src = v_ptr + t * v_row + h * v_head + d
        tl.store(vc_ptr + dst, tl.load(src, mask=mask, other=0.0).to(cdt), mask=mask)
        tl.store(vc_ptr + dst + half, tl.load(src + half, mask=mask, other=0.0).to(cdt),
                 mask=mask)


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, positions: torch.Tensor,
                  k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                  slots: torch.Tensor | None = None) -> None:
    """Rotate q [T, H, D] and k [T, KVH, D] in place at int `positions` [T] with cos/sin
    [max_pos, D]; then write k, v [T, KVH, D] to `slots` [T] (-1: skipped) of caches
    [num_blocks, block_size, KVH, D] (any strides with a contiguous last dim)."""
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    assert dim % 2 == 0 and k.shape[2] == dim and v.shape[2] == dim
    assert all(t.stride(-1) == 1 for t in (q, k, v, cos, sin))
    assert cos.stride() == sin.stride()
    if tokens == 0:
        return
    store = k_cache is not None
    if store:
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
        cache_strides = k_cache.stride()[:3]
        block_size = k_cache.shape[1]
    else:
        k_cache, v_cache, slots = k, v, positions  # unused: STORE is off
        cache_strides, block_size = (0, 0, 0), 1
    _rope_store_kv_kernel[(tokens,)](
        q, k, v, cos, sin, positions, k_cache, v_cache, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), *cache_strides, block_size, heads, kv_heads, dim // 2,
        STORE=store, BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_KVH=triton.next_power_of_2(kv_heads),
        BLOCK_HALF=triton.next_power_of_2(dim // 2))
