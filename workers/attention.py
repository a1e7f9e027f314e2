"""Attention over the paged KV cache (torch backend: CPU and reference).

The KV cache of a layer is two tensors [num_slots, kv_heads, head_dim], slot = block * size +
offset. A step writes its new K/V at `slot_mapping`, then attends:
- all decode rows (one query each) in one batched SDPA call over their padded contexts;
- each prefill chunk in its own SDPA call (causal within the chunk, full over earlier tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class PrefillSeq:
    start: int  # first row of this chunk in the flattened batch
    end: int
    ctx_slots: torch.Tensor  # [ctx_len] cache slots of positions 0..ctx_len-1
    start_pos: int  # position of the chunk's first token


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of every token in the batch
    decode_rows: torch.Tensor | None  # [B] rows of single-token (decode) queries
    decode_slots: torch.Tensor | None  # [B, L] padded context slots
    decode_mask: torch.Tensor | None  # [B, 1, 1, L] True where a key is visible
    prefills: list[PrefillSeq]

    @classmethod
    def build(
        cls, seqs: list[tuple[np.ndarray, int, int]], block_size: int
    ) -> AttentionMetadata:
        """seqs: (block_table, start_pos, num_tokens) in batch order."""
        slot_parts, prefills = [], []
        dec_rows, dec_ctx = [], []
        row = 0
        for table, start, n in seqs:
            ctx_len = start + n
            pos = np.arange(ctx_len, dtype=np.int64)
            slots = table[pos // block_size].astype(np.int64) * block_size + pos % block_size
            slot_parts.append(slots[start:])
            if n == 1:
                dec_rows.append(row)
                dec_ctx.append(slots)
            else:
                prefills.append(PrefillSeq(row, row + n, torch.from_numpy(slots), start))
            row += n
        slot_mapping = torch.from_numpy(np.concatenate(slot_parts))
        if not dec_rows:
            return cls(slot_mapping, None, None, None, prefills)
        width = max(len(c) for c in dec_ctx)
        padded = np.zeros((len(dec_ctx), width), dtype=np.int64)
        mask = np.zeros((len(dec_ctx), width), dtype=bool)
        for i, c in enumerate(dec_ctx):
            padded[i, : len(c)] = c
            mask[i, : len(c)] = True
        return cls(
            slot_mapping,
            torch.tensor(dec_rows, dtype=torch.int64),
            torch.from_numpy(padded),
            torch.from_numpy(mask)[:, None, None, :],
            prefills,
        )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D] (this step's). Returns [T, H, D]."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    gqa = q.shape[1] != k.shape[1]
    if meta.decode_rows is not None and not meta.prefills:
        return _decode(q, k_cache, v_cache, meta, scale, gqa)
    out = torch.empty_like(q)
    if meta.decode_rows is not None:
        out[meta.decode_rows] = _decode(q[meta.decode_rows], k_cache, v_cache, meta, scale, gqa)
    for p in meta.prefills:
        qs = q[p.start: p.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if p.start_pos == 0:
            # The whole context is this chunk: use it directly, plain causal mask.
            ks = k[p.start: p.end].transpose(0, 1).unsqueeze(0)
            vs = v[p.start: p.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                               enable_gqa=gqa)
        else:
            ks = k_cache[p.ctx_slots].transpose(0, 1).unsqueeze(0)  # [1, KVH, ctx, D]
            vs = v_cache[p.ctx_slots].transpose(0, 1).unsqueeze(0)
            n, ctx = p.end - p.start, len(p.ctx_slots)
            q_pos = torch.arange(p.start_pos, p.start_pos + n).unsqueeze(1)
            mask = torch.arange(ctx).unsqueeze(0) <= q_pos
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                               enable_gqa=gqa)
        out[p.start: p.end] = o.squeeze(0).transpose(0, 1)
    return out


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, gqa: bool):
    qd = q.unsqueeze(2)  # [B, H, 1, D]
    kd = k_cache[meta.decode_slots].transpose(1, 2)  # [B, KVH, L, D]
    vd = v_cache[meta.decode_slots].transpose(1, 2)
    o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale,
                                       enable_gqa=gqa)
    return o.squeeze(2)
