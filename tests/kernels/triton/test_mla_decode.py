"""MLA decode attention in the latent space (paged latent + rotary-key caches) against the torch
reference: ordinary paged attention with one KV head whose key is [c, k_r] and value c."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.triton.mla_decode import mla_decode_attention, mla_decode_attention_ref
from tests.kernels.triton.device import DEVICE, DTYPES, check, tolerance
from tests.kernels.triton.paged_cases import free_below, make_cache


def run_case(dtype: torch.dtype, heads: int, latent: int, rope: int, num_splits: int | None,
             seed: int, batch: int = 3, block_size: int = 4, max_keys: int = 37,
             window: int | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    lat = make_cache(gen, batch, 1, latent, block_size, max_keys, dtype)  # .k: the latents
    rope_cache = torch.randn(lat.k.shape[:3] + (rope,), generator=gen).to(DEVICE, dtype)
    q_latent = torch.randn(batch, heads, latent, generator=gen).to(DEVICE, dtype)
    q_rope = torch.randn(batch, heads, rope, generator=gen).to(DEVICE, dtype)
    key_hi = torch.randint(1, max_keys + 1, (batch,), generator=gen, dtype=torch.int32)
    key_hi[0] = max_keys  # one full row
    key_lo = torch.zeros(batch, dtype=torch.int32)
    if window is not None:  # as a sliding layer leaves them: blocks below freed, lo raised
        for b in range(batch):
            free_below(lat, b, max(0, int(key_hi[b]) - window))
        key_lo = (key_hi - window).clamp(min=0)
    if batch > 2:
        key_hi[2] = key_lo[2]  # a row that sees nothing: zeros
    scale = (latent + rope) ** -0.5
    args = (q_latent, q_rope, lat.k, rope_cache, lat.tables, key_lo.to(DEVICE),
            key_hi.to(DEVICE))
    out = mla_decode_attention(*args, scale, num_splits=num_splits, block_n=16)
    cpu = [t.cpu().float() if t.is_floating_point() else t.cpu() for t in args]
    ref = mla_decode_attention_ref(*cpu, scale)
    assert out.dtype == dtype and out.shape == (batch, heads, latent)
    check("mla_decode", out, ref, tolerance(dtype))
    if batch > 2:
        assert torch.equal(out[2].cpu().float(), torch.zeros(heads, latent))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [16, 20])  # one block of heads, and a partial second one
@pytest.mark.parametrize("num_splits", [1, 3])
def test_heads_and_splits(dtype: torch.dtype, heads: int, num_splits: int) -> None:
    run_case(dtype, heads, latent=32, rope=16, num_splits=num_splits, seed=heads + num_splits)


def test_odd_widths_and_a_window_over_freed_blocks() -> None:
    """Widths that are not powers of two (padded lanes masked), key_lo raised past freed
    blocks, the default split count."""
    run_case(torch.float32, heads=3, latent=24, rope=8, num_splits=None, seed=5, window=10,
             max_keys=45)


def test_splits_do_not_change_the_result() -> None:
    one = run_case(torch.float32, heads=16, latent=32, rope=16, num_splits=1, seed=9)
    four = run_case(torch.float32, heads=16, latent=32, rope=16, num_splits=4, seed=9)
    torch.testing.assert_close(one, four, rtol=1e-5, atol=1e-5)
