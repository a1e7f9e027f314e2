"""Attention in plain torch over the paged cache: the reference, and the path for any device.

- All decode rows (one query each) in one batched SDPA call over their block-gathered contexts
  (gathering whole blocks with one index_select is ~1.5x cheaper than gathering slots), masked
  to each row's visible range.
- Each prefill chunk in its own SDPA call: causal within the chunk when the chunk is the whole
  context, else over its gathered blocks with an explicit mask (causal, sliding window, replay
  start).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.workers.attention.base import AttentionBackend
from deepinfer.workers.attention.metadata import AttentionMetadata


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, batch: int,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """[B * MB] block ids -> [B, KVH, MB * block_size, D] keys or values (as `dtype`: the
    queries' when --kv-cache-dtype stores another)."""
    g = cache.index_select(0, blocks)
    if dtype is not None and g.dtype != dtype:
        g = g.to(dtype)
    return g.view(batch, -1, cache.shape[2], cache.shape[3]).transpose(1, 2)


def as_stored(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """This step's keys or values as the cache holds them (rounded to --kv-cache-dtype): every
    attention reads the stored K/V, so a prompt's logits do not depend on where its chunks or
    a prefix-cache hit fall."""
    return x if cache.dtype == x.dtype else x.to(cache.dtype).to(x.dtype)


class TorchAttention(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float
                ) -> torch.Tensor:
        gqa = q.shape[1] != k.shape[1]
        if meta.decode_rows is not None and not meta.prefills:
            return self.decode(q, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)
        if meta.decode_rows is not None:
            out[meta.decode_rows] = self.decode(q[meta.decode_rows], k_cache, v_cache, meta,
                                                scale)
        for p in meta.prefills:
            qs = q[p.start: p.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if p.fresh:
                ks = as_stored(k[p.start: p.end], k_cache).transpose(0, 1).unsqueeze(0)
                vs = as_stored(v[p.start: p.end], v_cache).transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                   enable_gqa=gqa)
            else:
                ctx = p.ctx_len - p.first_key
                ks = gather_blocks(k_cache, p.blocks, 1, q.dtype)[:, :, :ctx]
                vs = gather_blocks(v_cache, p.blocks, 1, q.dtype)[:, :, :ctx]
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=p.mask(meta.window),
                                                   scale=scale, enable_gqa=gqa)
            out[p.start: p.end] = o.squeeze(0).transpose(0, 1)
        return out

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Decode rows [B, H, D] over their tables: gather the blocks, mask, one SDPA call."""
        batch = q.shape[0]
        kd = gather_blocks(k_cache, meta.decode_blocks, batch, q.dtype)
        vd = gather_blocks(v_cache, meta.decode_blocks, batch, q.dtype)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd,
                                           attn_mask=meta.decode_mask(kd.shape[2]),
                                           scale=scale, enable_gqa=q.shape[1] != kd.shape[1])
        return o.squeeze(2)
