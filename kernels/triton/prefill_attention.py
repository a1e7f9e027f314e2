"""Prefill attention: chunks of new query tokens over the paged KV cache, variable lengths in
one launch, causal, optionally sliding, with optional sinks.

Sequence s owns query rows [q_start[s], q_start[s] + q_len[s]) of q [T, H, D] (packed rows:
q_start = cu_seqlens[:-1]; rows of other kinds, e.g. decode rows, may sit between), at positions
q_pos0[s], q_pos0[s] + 1, ... counted from the start of its block table (block_tables[s, i]
holds positions [i * block_size, (i + 1) * block_size); -1: freed). The chunk's own K/V is
already in the cache (the rotary + store op writes it first, as on the CPU path), so a query at
position p attends to cached keys j with key_lo[s] <= j <= p and, with a window W, j > p - W.
From the metadata's PrefillSeq (workers/attention/metadata.py): q_pos0 = start_pos - first_key,
key_lo = max(key_from - first_key, 0), the table = its `blocks`.

A program per (sequence, tile of BLOCK_M queries, query head) runs flash attention over just
the keys its tile can see: from the lowest visible key (key_lo, or the window's start for the
tile's first query) to its last query. Keys are gathered per position through the table, so
the key tile need not match the cache block size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.triton.decode_attention import NEG, attend_ref, online_softmax_step

__all__ = ["prefill_attention", "prefill_attention_ref"]


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, start_ptr, len_ptr, pos0_ptr,
                    lo_ptr, sinks_ptr, scale, q_row, q_head, o_row, o_head, table_row,
                    c_block, c_slot, c_head, block_size, window, group, dim,
                    HAS_SINKS: tl.constexpr,
                    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // group
    first = tl.load(start_ptr + s).to(tl.int32)
    n = tl.load(len_ptr + s).to(tl.int32)
    pos0 = tl.load(pos0_ptr + s).to(tl.int32)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n
    q_pos = pos0 + rows
    d = tl.arange(0, BLOCK_D)
    d_ok = d < dim
    q_off = (first + rows).to(tl.int64)
    q = tl.load(q_ptr + q_off[:, None] * q_row + h * q_head + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    lo = tl.maximum(tl.load(lo_ptr + s).to(tl.int32), 0)
    key_lo = tl.where(window > 0, tl.maximum(lo, pos0 + tile * BLOCK_M - window + 1), lo)
    key_hi = tl.where(tile * BLOCK_M < n, pos0 + tl.minimum(tile * BLOCK_M + BLOCK_M, n), 0)
    m = tl.full([BLOCK_M], NEG, tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(key_lo, key_hi, BLOCK_N):
        k_pos = n0 + tl.arange(0, BLOCK_N)
        block = tl.load(tables_ptr + s * table_row + k_pos // block_size, mask=k_pos < key_hi,
                        other=-1)
        k_ok = (k_pos < key_hi) & (block >= 0)
        k_row = block.to(tl.int64) * c_block + (k_pos % block_size) * c_slot + kvh * c_head
        kd_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + k_row[:, None] + d[None, :], mask=kd_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [M, N] float32
        visible = (k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
                   & (k_pos[None, :] >= lo)
                   & ((window <= 0) | (k_pos[None, :] > q_pos[:, None] - window)))
        scores = tl.where(visible, scores, float("-inf"))
        m, alpha, p, denom = online_softmax_step(scores, m, denom)
        v = tl.load(v_ptr + k_row[:, None] + d[None, :], mask=kd_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32)
        m_all = tl.maximum(m, sink)
        alpha = tl.exp(m - m_all)
        denom = denom * alpha + tl.exp(sink - m_all)
        acc = acc * alpha[:, None]
    o = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out_ptr + q_off[:, None] * o_row + h * o_head + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor,
                      q_pos0: torch.Tensor, key_lo: torch.Tensor, scale: float, max_q_len: int,
                      window: int | None = None, sinks: torch.Tensor | None = None,
                      block_m: int = 16, block_n: int = 16,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D] (last dim contiguous); caches [num_blocks, block_size, KVH, D] with equal
    strides; block_tables [S, MB]; q_start, q_len, q_pos0, key_lo [S] ints; max_q_len:
    the longest chunk (a host int, so the grid needs no sync). Writes the sequences' rows of
    `out` (a new [T, H, D] tensor of q's dtype when None; other rows are left as they are)."""
    tokens, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert heads % kv_heads == 0 and k_cache.stride() == v_cache.stride()
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and block_tables.stride(-1) == 1
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.stride(-1) == 1
    num_seqs = q_pos0.shape[0]
    if tokens == 0 or num_seqs == 0 or max_q_len == 0:
        return out
    # float32 runs the dot products in full precision (TF32 would cost ~1e-3 of accuracy).
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (num_seqs, triton.cdiv(max_q_len, block_m), heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, q_start, q_len, q_pos0, key_lo,
        q if sinks is None else sinks, scale, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), block_tables.stride(0), *k_cache.stride()[:3], block_size, window or 0,
        heads // kv_heads, dim, HAS_SINKS=sinks is not None, PRECISION=precision,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(dim)),
        num_stages=2)  # two K/V buffers: 64-wide float32 tiles still fit in shared memory
    return out


def prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, q_start: torch.Tensor,
                          q_len: torch.Tensor, q_pos0: torch.Tensor, key_lo: torch.Tensor,
                          scale: float, window: int | None = None,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Sequence by sequence: gather its table's blocks, mask (causal, key_lo, window),
    `attend_ref`. Rows of no sequence are zeros."""
    out = torch.zeros_like(q)
    for s in range(q_pos0.shape[0]):
        first = int(q_start[s])
        last = first + int(q_len[s])
        blocks = block_tables[s].long().clamp(min=0)
        k = k_cache[blocks].flatten(0, 1)
        v = v_cache[blocks].flatten(0, 1)
        q_pos = torch.arange(last - first, device=q.device)[:, None] + int(q_pos0[s])
        k_pos = torch.arange(k.shape[0], device=q.device)[None, :]
        visible = (k_pos <= q_pos) & (k_pos >= int(key_lo[s]))
        if window:
            visible &= k_pos > q_pos - window
        out[first:last] = attend_ref(q[first:last], k, v, visible, scale, sinks)
    return out
