"""Paged decode attention: one query token per row over its block table, GQA, sinks, split-KV.

Same inputs as the CPU kernel (kernels/cpu/attention.py) and the attention metadata
(workers/attention/metadata.py): q [B, H, D]; caches [num_blocks, block_size, KVH, D];
block_tables[b, i] is the block holding positions [i * block_size, (i + 1) * block_size) of
row b (-1: freed, outside a sliding window); row b attends to positions [key_lo[b], key_hi[b]).
A sliding window is either folded into key_lo already (as the metadata does) or given here as
`window` (keys > key_hi - 1 - window, i.e. the W positions ending at the query). Optional
`sinks` [H] add one learned logit per head to the softmax denominator and nothing to the output
(gpt-oss, DeepSeek-V4). Rows with no visible key get zeros.

Split-KV (flash-decoding): a program per (row, KV head, split) walks its share of the keys with
an online softmax for all the query heads of its group, reading each K/V row once for the
group (its heads padded to 16 rows, so both products are tensor-core dots), and writes a
partial (max, sum, unnormalised output); a second kernel merges the splits by log-sum-exp and
folds in the sink. Splitting keeps the GPU busy when a few long rows are all there is (batch 1,
long context); with many rows one split each is enough.

`keys_per_split` (--deterministic) makes a row's result independent of its batch: splits of that
many keys from the row's first key (instead of a count chosen from the batch's size and widest
table), merged in split order one after another, so the splits past a short row's end (empty:
weight 0) add exact zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["attend_ref", "default_num_splits", "paged_decode_attention",
           "paged_decode_attention_ref"]

NEG = tl.constexpr(-1.0e30)  # a finite "minus infinity": exp(NEG - NEG) is 1, never NaN


@triton.jit
def online_softmax_step(s, m, denom):
    """A block of scores s [rows, N] into each row's running max m and sum denom: returns the
    new max, the factor the old sum and output scale by, the block's weights, the new sum."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    return m_new, alpha, p, denom * alpha + tl.sum(p, axis=1)


@triton.jit
def split_range(lo, hi, split, num_splits, BLOCK_N: tl.constexpr):
    """This split's share [start, end) of the keys [lo, hi), whole BLOCK_N blocks each."""
    lo = tl.maximum(lo, 0)
    per_split = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    return start, tl.minimum(start + per_split, hi)


@triton.jit
def key_block(tables_ptr, n0, end, block_size, BLOCK_N: tl.constexpr):
    """Positions [n0, n0 + BLOCK_N) of a row (tables_ptr: its table): which are keys to read
    (below end, in a block not freed) and each one's cache block, int64."""
    pos = n0 + tl.arange(0, BLOCK_N)
    valid = pos < end
    block = tl.load(tables_ptr + pos // block_size, mask=valid, other=-1)
    valid &= block >= 0  # a freed block is never read, whatever the range says
    return pos, valid, block.to(tl.int64)


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lo_ptr, hi_ptr, po_ptr, pm_ptr,
                         pl_ptr, scale, q_row, q_head, table_row, c_block, c_slot, c_head,
                         block_size, window, group, dim, num_splits, keys_per_split,
                         PRECISION: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    lo = tl.load(lo_ptr + b).to(tl.int32)
    hi = tl.load(hi_ptr + b).to(tl.int32)
    lo = tl.where(window > 0, tl.maximum(lo, hi - window), lo)
    if keys_per_split > 0:  # fixed runs from the row's first key (a multiple of BLOCK_N)
        start = tl.maximum(lo, 0) + split * keys_per_split
        end = tl.minimum(start + keys_per_split, hi)
    else:
        start, end = split_range(lo, hi, split, num_splits, BLOCK_N)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * group + g
    gd_mask = (g < group)[:, None] & (d < dim)[None, :]
    q = tl.load(q_ptr + b * q_row + heads[:, None] * q_head + d[None, :], mask=gd_mask,
                other=0.0)
    m = tl.full([BLOCK_G], NEG, tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos, valid, block = key_block(tables_ptr + b * table_row, n0, end, block_size, BLOCK_N)
        row = block * c_block + (pos % block_size) * c_slot + kvh * c_head
        nd_mask = valid[:, None] & (d < dim)[None, :]
        k = tl.load(k_ptr + row[:, None] + d[None, :], mask=nd_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [G, N] float32
        s = tl.where(valid[None, :], s, float("-inf"))
        m, alpha, p, denom = online_softmax_step(s, m, denom)
        v = tl.load(v_ptr + row[:, None] + d[None, :], mask=nd_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    part = (b * group * tl.num_programs(1) + heads) * num_splits + split  # [B, H, S] index
    g_mask = g < group
    tl.store(pm_ptr + part, m, mask=g_mask)
    tl.store(pl_ptr + part, denom, mask=g_mask)
    tl.store(po_ptr + part[:, None] * dim + d[None, :], acc, mask=gd_mask)


@triton.jit
def _decode_merge_kernel(po_ptr, pm_ptr, pl_ptr, sinks_ptr, out_ptr, out_row, out_head,
                         num_heads, dim, num_splits, HAS_SINKS: tl.constexpr,
                         IN_ORDER: tl.constexpr, BLOCK_S: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = sp < num_splits
    part = (b * num_heads + h) * num_splits + sp
    m = tl.load(pm_ptr + part, mask=s_mask, other=NEG)
    denom = tl.load(pl_ptr + part, mask=s_mask, other=0.0)
    m_all = tl.max(m, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32)
        m_all = tl.maximum(m_all, sink)
    if IN_ORDER:  # one split after another: the sum's order never depends on num_splits
        total = tl.zeros([], tl.float32)
        o = tl.zeros([BLOCK_D], tl.float32)
        first = (b * num_heads + h) * num_splits
        for i in range(0, num_splits):
            w_i = tl.exp(tl.load(pm_ptr + first + i) - m_all)
            total += w_i * tl.load(pl_ptr + first + i)
            o += w_i * tl.load(po_ptr + (first + i) * dim + d, mask=d < dim, other=0.0)
    else:
        w = tl.exp(m - m_all)
        total = tl.sum(w * denom, axis=0)
        acc = tl.load(po_ptr + part[:, None] * dim + d[None, :],
                      mask=s_mask[:, None] & (d < dim)[None, :], other=0.0)
        o = tl.sum(w[:, None] * acc, axis=0)
    if HAS_SINKS:
        total += tl.exp(sink - m_all)
    o = o / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * out_row + h * out_head + d, o.to(out_ptr.dtype.element_ty),
             mask=d < dim)


def default_num_splits(batch: int, kv_heads: int, max_keys: int,
                       target_programs: int = 256, min_keys_per_split: int = 256) -> int:
    """Enough splits to give the GPU ~target_programs programs, none shorter than
    min_keys_per_split keys (below that the merge costs more than the parallelism gains).
    Uses the table width, not the lengths, so it needs no device-to-host sync."""
    want = triton.cdiv(target_programs, max(batch * kv_heads, 1))
    return max(1, min(want, triton.cdiv(max_keys, min_keys_per_split), 64))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, key_lo: torch.Tensor,
                           key_hi: torch.Tensor, scale: float,
                           sinks: torch.Tensor | None = None, window: int | None = None,
                           num_splits: int | None = None, block_n: int = 32,
                           keys_per_split: int | None = None) -> torch.Tensor:
    """q [B, H, D] (last dim contiguous); caches [num_blocks, block_size, KVH, D] with equal
    strides; block_tables [B, MB] int32/int64; key_lo, key_hi [B] int; sinks [H] or None.
    `keys_per_split` (a multiple of block_n): batch-invariant splits of that many keys.
    Returns [B, H, D] in q's dtype."""
    batch, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert heads % kv_heads == 0 and k_cache.stride() == v_cache.stride()
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and block_tables.stride(-1) == 1
    out = torch.empty_like(q)
    if batch == 0:
        return out
    if keys_per_split:
        assert keys_per_split % block_n == 0
        num_splits = triton.cdiv(block_tables.shape[1] * block_size, keys_per_split)
    elif num_splits is None:
        num_splits = default_num_splits(batch, kv_heads, block_tables.shape[1] * block_size)
    group = heads // kv_heads
    parts = torch.empty(batch, heads, num_splits, dim, dtype=torch.float32, device=q.device)
    part_m = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    block_d = max(16, triton.next_power_of_2(dim))  # tl.dot's smallest tile is 16
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # no TF32 rounding in fp32
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, key_lo, key_hi, parts, part_m, part_l, scale,
        q.stride(0), q.stride(1), block_tables.stride(0), *k_cache.stride()[:3], block_size,
        window or 0, group, dim, num_splits, keys_per_split or 0, PRECISION=precision,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n, BLOCK_D=block_d)
    _decode_merge_kernel[(batch, heads)](
        parts, part_m, part_l, part_m if sinks is None else sinks, out, out.stride(0),
        out.stride(1), heads, dim, num_splits, HAS_SINKS=sinks is not None,
        IN_ORDER=bool(keys_per_split), BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=block_d)
    return out


def attend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
               scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Plain attention of q [n, H, D] over k, v [L, KVH, D] where visible [n, L]; sinks [H]
    join each head's softmax as one more logit. Rows that see nothing get zeros."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float() * scale, k)
    scores = scores.masked_fill(~visible[None], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(-1, 1, 1).expand(-1, q.shape[0], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)[..., : k.shape[0]]
    return torch.einsum("hnl,lhd->nhd", probs, v).to(q.dtype)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, key_lo: torch.Tensor,
                               key_hi: torch.Tensor, scale: float,
                               sinks: torch.Tensor | None = None,
                               window: int | None = None) -> torch.Tensor:
    """Row by row: gather the row's table blocks, mask outside its range, `attend_ref`.
    Without sinks this is kernels/cpu/attention.paged_decode_attention_ref's maths."""
    outs = []
    for b in range(q.shape[0]):
        blocks = block_tables[b].long().clamp(min=0)
        k = k_cache[blocks].flatten(0, 1)  # [MB * block_size, KVH, D]
        v = v_cache[blocks].flatten(0, 1)
        lo, hi = int(key_lo[b]), int(key_hi[b])
        if window:
            lo = max(lo, hi - window)
        pos = torch.arange(k.shape[0], device=q.device)
        visible = ((pos >= lo) & (pos < hi))[None]
        outs.append(attend_ref(q[b: b + 1], k, v, visible, scale, sinks))
    return torch.cat(outs) if outs else torch.empty_like(q)
