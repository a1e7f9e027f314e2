"""Attention over the paged KV cache (torch backend: CPU and reference).

A layer's cache is two tensors [num_blocks, block_size, kv_heads, head_dim]. A step writes its
new K/V at `slot_mapping` (slot = block * block_size + offset), then attends:
- all decode rows (one query each) in one batched SDPA call over their block-gathered contexts
  (gathering whole blocks with one index_select is ~1.5x cheaper than gathering slots);
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
    blocks: torch.Tensor  # [num_blocks] the request's block table (covers the context)
    ctx_len: int
    start_pos: int  # position of the chunk's first token


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of every token in the batch
    decode_rows: torch.Tensor | None  # [B] rows of single-token (decode) queries
    decode_blocks: torch.Tensor | None  # [B * MB] padded block tables, flattened
    decode_mask: torch.Tensor | None  # [B, 1, 1, MB * block_size] True where a key is visible
    prefills: list[PrefillSeq]

    @classmethod
    def build(
        cls, seqs: list[tuple[np.ndarray, int, int]], block_size: int
    ) -> AttentionMetadata:
        """seqs: (block_table, start_pos, num_tokens) in batch order."""
        slot_parts, prefills, dec_rows, dec_tables, dec_lens = [], [], [], [], []
        row = 0
        for table, start, n in seqs:
            pos = np.arange(start, start + n, dtype=np.int64)
            slot_parts.append(table[pos // block_size].astype(np.int64) * block_size
                              + pos % block_size)
            used = table[: -(-(start + n) // block_size)]
            if n == 1:
                dec_rows.append(row)
                dec_tables.append(used)
                dec_lens.append(start + 1)
            else:
                prefills.append(PrefillSeq(row, row + n, torch.from_numpy(used.astype(np.int64)),
                                           start + n, start))
            row += n
        slot_mapping = torch.from_numpy(np.concatenate(slot_parts))
        if not dec_rows:
            return cls(slot_mapping, None, None, None, prefills)
        width = max(len(t) for t in dec_tables)
        padded = np.zeros((len(dec_tables), width), dtype=np.int64)
        for i, t in enumerate(dec_tables):
            padded[i, : len(t)] = t
        mask = np.arange(width * block_size)[None, :] < np.asarray(dec_lens)[:, None]
        return cls(
            slot_mapping,
            torch.tensor(dec_rows, dtype=torch.int64),
            torch.from_numpy(padded.reshape(-1)),
            torch.from_numpy(mask)[:, None, None, :],
            prefills,
        )


def _gather(cache: torch.Tensor, blocks: torch.Tensor, batch: int) -> torch.Tensor:
    """[B * MB] block ids -> [B, KVH, MB * block_size, D] keys or values."""
    g = cache.index_select(0, blocks)
    return g.view(batch, -1, cache.shape[2], cache.shape[3]).transpose(1, 2)


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
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, meta.slot_mapping, v)
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
            ks = _gather(k_cache, p.blocks, 1)[:, :, : p.ctx_len]
            vs = _gather(v_cache, p.blocks, 1)[:, :, : p.ctx_len]
            n = p.end - p.start
            q_pos = torch.arange(p.start_pos, p.start_pos + n).unsqueeze(1)
            mask = torch.arange(p.ctx_len).unsqueeze(0) <= q_pos
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                               enable_gqa=gqa)
        out[p.start: p.end] = o.squeeze(0).transpose(0, 1)
    return out


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, gqa: bool):
    batch = q.shape[0]
    kd = _gather(k_cache, meta.decode_blocks, batch)
    vd = _gather(v_cache, meta.decode_blocks, batch)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, attn_mask=meta.decode_mask,
                                       scale=scale, enable_gqa=gqa)
    return o.squeeze(2)
