"""Multi-head latent attention (DeepSeek-V2/V3) over the paged latent cache, in plain torch.

Each cached token holds one compressed latent c (kv_lora_rank wide, normed) and one rotary key
k_r shared by all heads (the LATENT entry of engine/kv_layout.py). Head h's key and value are
k_h = [W_UK_h c, k_r] and v_h = W_UV_h c, with W_UK, W_UV the two halves of kv_b_proj.

- Prefill chunks expand the context's latents into per-head keys and values (one GEMM over
  the context) and attend as ordinary attention: cheapest when many queries share the context.
- Decode rows attend in the latent space instead (the absorbed weights): q_h's no-rope part is
  turned into the latent space once, q'_h = W_UK_h^T q_h, so the scores are q'_h . c + q_r . k_r,
  the output is W_UV_h (sum_j p_j c_j). Per key that reads kv_lora_rank + rope floats instead
  of expanding a key and a value for every head. With the Triton backend's metadata (a GPU)
  that attention is one kernel launch (kernels/triton/mla_decode.py).
Both compute the same attention; the tests hold them to HF's expanded reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.workers.attention.metadata import AttentionMetadata
from deepinfer.workers.attention.torch_backend import gather_blocks


def mla_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, rope_cache: torch.Tensor,
                  latent_cache: torch.Tensor, meta: AttentionMetadata, kv_b: torch.Tensor,
                  v_head_dim: int, scale: float) -> torch.Tensor:
    """q_nope [T, H, N], q_rope [T, H, R] (rotated; this step's latents already cached),
    caches [blocks, block_size, 1, R | L], kv_b [H * (N + V), L] -> [T, H, V]."""
    t, heads, nope = q_nope.shape
    w = kv_b.view(heads, nope + v_head_dim, -1)
    w_uk, w_uv = w[:, :nope], w[:, nope:]  # [H, N, L], [H, V, L]
    out = q_nope.new_empty(t, heads, v_head_dim)
    if meta.decode_rows is not None:
        rows = meta.decode_rows
        out[rows] = _decode_absorbed(q_nope[rows], q_rope[rows], rope_cache, latent_cache,
                                     meta, w_uk, w_uv, scale)
    for p in meta.prefills:
        ctx = p.ctx_len - p.first_key
        latent = gather_blocks(latent_cache, p.blocks, 1)[0, 0, :ctx]  # [ctx, L]
        k_rope = gather_blocks(rope_cache, p.blocks, 1)[0, 0, :ctx]  # [ctx, R]
        kv = F.linear(latent, kv_b).view(ctx, heads, nope + v_head_dim)
        k = torch.cat([kv[..., :nope], k_rope.unsqueeze(1).expand(ctx, heads, -1)], dim=-1)
        q = torch.cat([q_nope[p.start: p.end], q_rope[p.start: p.end]], dim=-1)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), kv[..., nope:].transpose(0, 1),
            attn_mask=p.mask(meta.window), scale=scale)
        out[p.start: p.end] = o.transpose(0, 1)
    return out


def _decode_absorbed(q_nope, q_rope, rope_cache, latent_cache, meta: AttentionMetadata,
                     w_uk, w_uv, scale: float) -> torch.Tensor:
    batch = q_nope.shape[0]
    q_latent = torch.einsum("bhn,hnl->bhl", q_nope, w_uk)
    if meta.device_tables:  # the device's tables and key ranges, one launch
        from deepinfer.kernels.triton.mla_decode import mla_decode_attention

        o = mla_decode_attention(q_latent.contiguous(), q_rope.contiguous(), latent_cache,
                                 rope_cache, meta.decode_tables, meta.decode_lo_dev,
                                 meta.decode_hi_dev, scale)  # [B, H, L]
        return torch.einsum("bhl,hvl->bhv", o, w_uv)
    latent = gather_blocks(latent_cache, meta.decode_blocks, batch)  # [B, 1, keys, L]
    k_rope = gather_blocks(rope_cache, meta.decode_blocks, batch)  # [B, 1, keys, R]
    q = torch.cat([q_latent, q_rope], dim=-1).unsqueeze(2)  # [B, H, 1, L + R]
    k = torch.cat([latent, k_rope], dim=-1)
    o = F.scaled_dot_product_attention(q, k, latent, attn_mask=meta.decode_mask(k.shape[2]),
                                       scale=scale, enable_gqa=True)  # [B, H, 1, L]
    return torch.einsum("bhl,hvl->bhv", o.squeeze(2), w_uv)
