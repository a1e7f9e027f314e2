"""Decode attention straight over the paged KV cache on CPU: a native kernel and its reference.

`paged_decode_attention` reads K/V where they sit in the cache (no gather, no mask): parallel
over rows, long rows split into runs of blocks whose partial softmax states are combined
(flash-decoding, so a few long rows still use every thread), online softmax in float32. The
C++ source (csrc/paged_attention.cpp) is built by torch's cpp_extension on first use (~10 s)
and cached under the torch extensions dir. `available(*tensors)` says, never raising, whether
it can be used; callers fall back to the gather + SDPA path (or `paged_decode_attention_ref`)
when it says no.

block_tables[b, i] is the cache block holding positions [i * block_size, (i + 1) * block_size)
of row b; the row attends to positions [key_lo[b], key_hi[b]). Only the blocks of that range are
read (others may be -1). A table that starts at position `first` works with key_lo - first and
key_hi - first. Rows with key_lo >= key_hi get zeros.
"""

from __future__ import annotations

import torch

from deepinfer.kernels.cpu.native import NativeOp

_OP = NativeOp("paged_attention", "paged_attention.cpp", "paged_decode_attention")


def build_error() -> str | None:
    """Why the extension could not be built (None: built, or not tried yet)."""
    return _OP.error


# What the kernel reads a KV cache as (--kv-cache-dtype): q and the output stay float32.
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def available(*tensors: torch.Tensor | None) -> bool:
    """True when the kernel is built (building it on first call) and takes these float32
    tensors (q)."""
    return _OP.available(*tensors)


def takes_cache(cache: torch.Tensor) -> bool:
    """True when the kernel reads this KV cache (float32, float16 or bfloat16, on the CPU)."""
    return cache.device.type == "cpu" and cache.dtype in CACHE_DTYPES


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, key_lo: torch.Tensor, key_hi: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """q [B, H, D] float32; caches [num_blocks, block_size, KVH, D] (CACHE_DTYPES); block_tables
    [B, MB] int32/int64; key_lo, key_hi [B] int32. Returns [B, H, D] float32. Call `available`
    and `takes_cache` first."""
    return _OP(q, k_cache, v_cache, block_tables, key_lo, key_hi, scale)


# Blocks per run of a row under --deterministic: long rows still spread over the threads.
FIXED_SPLIT_BLOCKS = 16


def set_fixed_split(blocks: int) -> None:
    """Split every row into runs of exactly `blocks` blocks (> 0: batch-invariant results,
    --deterministic) or as the batch's size suits (0, the default). Process-wide; call
    `available` first."""
    _OP.sibling("paged_attention_fixed_split")(blocks)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, key_lo: torch.Tensor,
                               key_hi: torch.Tensor, scale: float) -> torch.Tensor:
    """Pure-torch reference: gather every table block, mask outside [key_lo, key_hi), softmax."""
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    blocks = block_tables.long().clamp(min=0).reshape(-1)
    k = k_cache[blocks].to(q.dtype).view(batch, -1, kv_heads, dim).transpose(1, 2)  # [B,KVH,L,D]
    v = v_cache[blocks].to(q.dtype).view(batch, -1, kv_heads, dim).transpose(1, 2)
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    pos = torch.arange(k.shape[2])
    visible = (pos >= key_lo.long()[:, None]) & (pos < key_hi.long()[:, None])  # [B, L]
    scores = torch.einsum("bhd,bhld->bhl", q * scale, k)
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # empty rows -> zeros
    return torch.einsum("bhl,bhld->bhd", probs, v)
