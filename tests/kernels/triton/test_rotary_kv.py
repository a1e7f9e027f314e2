"""Rotary + KV-cache store against the CPU path's torch reference."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.triton.rotary_kv import rope_store_kv, rope_store_kv_ref
from tests.kernels.triton.device import DEVICE, DTYPES, check, tolerance


def tables(max_pos: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (3, 3, 24), (8, 1, 32)])
@pytest.mark.parametrize("store", [False, True])
def test_rope_store_kv(dtype: torch.dtype, heads: int, kv_heads: int, dim: int,
                       store: bool) -> None:
    gen = torch.Generator().manual_seed(heads * dim)
    tokens, block_size, num_blocks = 5, 4, 6
    cos, sin = tables(64, dim)
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    # q, k, v as strided views of one fused qkv output, as the model produces them
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(DEVICE, dtype)
    positions = torch.tensor([0, 7, 8, 33, 63], device=DEVICE)
    slots = torch.tensor([0, 5, -1, 23, 9], device=DEVICE)

    def split(t: torch.Tensor):
        q, k, v = t.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        return (q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim),
                v.view(tokens, kv_heads, dim))

    caches = [torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(DEVICE, dtype)
              for _ in range(2)]
    out_qkv, ref_qkv = qkv.clone(), qkv.clone()
    out_c = [c.clone() for c in caches] if store else [None, None]
    ref_c = [c.clone() for c in caches] if store else [None, None]
    rope_store_kv(*split(out_qkv), cos, sin, positions, *out_c, slots if store else None)
    rope_store_kv_ref(*split(ref_qkv), cos, sin, positions, *ref_c, slots if store else None)
    tol = tolerance(dtype) * 4
    check("rotary q,k", out_qkv, ref_qkv, tol)
    if store:
        check("kv store", torch.stack(out_c), torch.stack(ref_c), tol)
        untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
        untouched[[0, 5, 23, 9]] = False
        assert torch.equal(out_c[0].view(-1, kv_heads, dim)[untouched.to(DEVICE)],
                           caches[0].view(-1, kv_heads, dim)[untouched.to(DEVICE)])
