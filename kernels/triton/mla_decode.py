"""MLA decode attention (DeepSeek-V2/V3) in the latent space, over the paged latent cache.

The absorbed form of workers/attention/mla.py's decode rows: every head attends to one shared
key and value per token, the token's compressed latent c (L wide) and its rotary key k_r (R
wide), kept in two paged caches [num_blocks, block_size, 1, L | R]. Head h's query arrives
already turned into the latent space (q'_h = W_UK_h^T q_h, [B, H, L]) with its rotated rope part
q_r [B, H, R]:

    score_j = (q'_h . c_j + q_r . k_r,j) * scale,   out_h = sum_j softmax(score)_j c_j  [L]

and the caller applies W_UV_h to out_h. Block tables and key ranges are those of the other
decode kernels (kernels/triton/decode_attention.py): row b attends to positions
[key_lo[b], key_hi[b]) through block_tables[b] (-1: freed); rows with no visible key get zeros.

A program per (row, block of heads, split of the keys) reads each latent once for its heads
(both products tensor-core dots, the heads padded to 16 rows) with an online softmax, and writes
a partial (max, sum, unnormalised output); decode_attention's merge kernel combines the splits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.triton.decode_attention import (
    NEG,
    _decode_merge_kernel,
    default_num_splits,
    key_block,
    online_softmax_step,
    paged_decode_attention_ref,
    split_range,
)

__all__ = ["mla_decode_attention", "mla_decode_attention_ref"]


@triton.jit
def _mla_split_kernel(ql_ptr, qr_ptr, lat_ptr, rope_ptr, tables_ptr, lo_ptr, hi_ptr, po_ptr,
                      pm_ptr, pl_ptr, scale, ql_row, ql_head, qr_row, qr_head, table_row,
                      lat_block, lat_slot, rope_block, rope_slot, block_size, heads, latent,
                      rope, num_splits, PRECISION: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    start, end = split_range(tl.load(lo_ptr + b).to(tl.int32), tl.load(hi_ptr + b).to(tl.int32),
                             split, num_splits, BLOCK_N)

    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    dl = tl.arange(0, BLOCK_L)
    dr = tl.arange(0, BLOCK_R)
    h_mask = h < heads
    hl_mask = h_mask[:, None] & (dl < latent)[None, :]
    q_lat = tl.load(ql_ptr + b * ql_row + h[:, None] * ql_head + dl[None, :], mask=hl_mask,
                    other=0.0)
    q_rope = tl.load(qr_ptr + b * qr_row + h[:, None] * qr_head + dr[None, :],
                     mask=h_mask[:, None] & (dr < rope)[None, :], other=0.0)
    m = tl.full([BLOCK_H], NEG, tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos, valid, block = key_block(tables_ptr + b * table_row, n0, end, block_size, BLOCK_N)
        slot = pos % block_size
        c = tl.load(lat_ptr + (block * lat_block + slot * lat_slot)[:, None] + dl[None, :],
                    mask=valid[:, None] & (dl < latent)[None, :], other=0.0)  # [N, L]
        k_r = tl.load(rope_ptr + (block * rope_block + slot * rope_slot)[:, None] + dr[None, :],
                      mask=valid[:, None] & (dr < rope)[None, :], other=0.0)  # [N, R]
        s = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)
        s += tl.dot(q_rope, tl.trans(k_r), input_precision=PRECISION)
        s = tl.where(valid[None, :], s * scale, float("-inf"))  # [H, N] float32
        m, alpha, p, denom = online_softmax_step(s, m, denom)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=PRECISION)
    part = (b * heads + h) * num_splits + split  # [B, H, S] index
    tl.store(pm_ptr + part, m, mask=h_mask)
    tl.store(pl_ptr + part, denom, mask=h_mask)
    tl.store(po_ptr + part[:, None] * latent + dl[None, :], acc, mask=hl_mask)


def mla_decode_attention(q_latent: torch.Tensor, q_rope: torch.Tensor,
                         latent_cache: torch.Tensor, rope_cache: torch.Tensor,
                         block_tables: torch.Tensor, key_lo: torch.Tensor, key_hi: torch.Tensor,
                         scale: float, num_splits: int | None = None, block_n: int = 32,
                         block_h: int = 16) -> torch.Tensor:
    """q_latent [B, H, L], q_rope [B, H, R] (last dims contiguous); latent_cache
    [num_blocks, block_size, 1, L], rope_cache [num_blocks, block_size, 1, R]; block_tables
    [B, MB] int32/int64; key_lo, key_hi [B]. Returns [B, H, L] in q_latent's dtype."""
    batch, heads, latent = q_latent.shape
    rope = q_rope.shape[-1]
    block_size = latent_cache.shape[1]
    assert latent_cache.shape[2] == rope_cache.shape[2] == 1, "one shared latent per token"
    assert q_latent.stride(-1) == q_rope.stride(-1) == 1
    assert latent_cache.stride(-1) == rope_cache.stride(-1) == block_tables.stride(-1) == 1
    out = torch.empty_like(q_latent)
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = default_num_splits(batch, triton.cdiv(heads, block_h),
                                        block_tables.shape[1] * block_size)
    parts = torch.empty(batch, heads, num_splits, latent, dtype=torch.float32,
                        device=q_latent.device)
    part_m = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q_latent.device)
    part_l = torch.empty_like(part_m)
    block_l = max(16, triton.next_power_of_2(latent))  # tl.dot's smallest tile is 16
    precision = "ieee" if q_latent.dtype == torch.float32 else "tf32"
    _mla_split_kernel[(batch, triton.cdiv(heads, block_h), num_splits)](
        q_latent, q_rope, latent_cache, rope_cache, block_tables, key_lo, key_hi, parts, part_m,
        part_l, scale, q_latent.stride(0), q_latent.stride(1), q_rope.stride(0),
        q_rope.stride(1), block_tables.stride(0), latent_cache.stride(0),
        latent_cache.stride(1), rope_cache.stride(0), rope_cache.stride(1), block_size, heads,
        latent, rope, num_splits, PRECISION=precision, BLOCK_H=max(16, block_h),
        BLOCK_N=block_n, BLOCK_L=block_l, BLOCK_R=max(16, triton.next_power_of_2(rope)))
    _decode_merge_kernel[(batch, heads)](
        parts, part_m, part_l, part_m, out, out.stride(0), out.stride(1), heads, latent,
        num_splits, HAS_SINKS=False, IN_ORDER=False, BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=block_l)
    return out


def mla_decode_attention_ref(q_latent: torch.Tensor, q_rope: torch.Tensor,
                             latent_cache: torch.Tensor, rope_cache: torch.Tensor,
                             block_tables: torch.Tensor, key_lo: torch.Tensor,
                             key_hi: torch.Tensor, scale: float) -> torch.Tensor:
    """The same as ordinary paged decode attention with one KV head whose key is the token's
    [c, k_r] and whose value is c (plain torch, float32)."""
    q = torch.cat([q_latent, q_rope], dim=-1).float()
    keys = torch.cat([latent_cache, rope_cache], dim=-1).float()
    return paged_decode_attention_ref(q, keys, latent_cache.float(), block_tables, key_lo,
                                      key_hi, scale)  # [B, H, L]: the values' width
