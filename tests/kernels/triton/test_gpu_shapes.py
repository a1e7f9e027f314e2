"""Model-sized shapes (head_dim 128, long contexts, wide rows), on the GPU only: the compiled
kernels' tiling, tensor-core dots and split-KV at the sizes they will serve. The interpreter
would take minutes over them, and the small-shape tests already cover the maths on CPU."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.triton.bitmask import apply_token_bitmask, apply_token_bitmask_ref
from deepinfer.kernels.triton.decode_attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
)
from deepinfer.kernels.triton.prefill_attention import prefill_attention, prefill_attention_ref
from deepinfer.kernels.triton.rmsnorm import add_rms_norm, add_rms_norm_ref
from deepinfer.kernels.triton.silu_mul import silu_and_mul, silu_and_mul_ref
from tests.kernels.triton.device import DTYPES, ON_GPU, check, scaled, tolerance
from tests.kernels.triton.paged_cases import free_below, make_cache
from tests.kernels.triton.test_mla_decode import run_case as run_mla_case

pytestmark = pytest.mark.skipif(not ON_GPU, reason="model-sized shapes run on the GPU only")


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_wide_rows(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4096, generator=gen).cuda().to(dtype)
    res = torch.randn(64, 4096, generator=gen).cuda().to(dtype)
    w = torch.randn(4096, generator=gen).cuda().to(dtype)
    r1, r2 = res.clone(), res.clone()
    ref = add_rms_norm_ref(x, r2, w, 1e-6)
    check("rmsnorm", add_rms_norm(x, r1, w, 1e-6), ref, 2 * scaled(dtype, ref))
    check("rmsnorm residual", r1, r2, tolerance(dtype))
    gate_up = torch.randn(64, 2 * 11008, generator=gen).cuda().to(dtype)
    ref = silu_and_mul_ref(gate_up)
    check("silu_and_mul", silu_and_mul(gate_up), ref, 2 * scaled(dtype, ref))
    logits = torch.randn(8, 151936, generator=gen).cuda().to(dtype)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (8, 151936 // 32), generator=gen,
                            dtype=torch.int64).to(torch.int32).cuda()
    out, ref = logits.clone(), logits.clone()
    apply_token_bitmask(out, bitmask, [0, 5, 7])
    apply_token_bitmask_ref(ref, bitmask, [0, 5, 7])
    check("bitmask", out, ref, 1e-30)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,max_keys,window,splits", [(1, 8192, None, None),
                                                          (32, 1500, None, None),
                                                          (4, 3000, 1024, 6)])
def test_decode_long_contexts(dtype: torch.dtype, batch: int, max_keys: int,
                              window: int | None, splits: int | None) -> None:
    gen = torch.Generator().manual_seed(batch)
    cache = make_cache(gen, batch, 8, 128, 16, max_keys, dtype)
    q = torch.randn(batch, 64, 128, generator=gen).cuda().to(dtype)
    hi = torch.randint(1, max_keys + 1, (batch,), generator=gen, dtype=torch.int32)
    hi[0] = max_keys
    lo = torch.zeros(batch, dtype=torch.int32)
    if window:
        for b in range(batch):
            free_below(cache, b, max(0, int(hi[b]) - window))
    sinks = torch.randn(64, generator=gen).cuda()
    out = paged_decode_attention(q, cache.k, cache.v, cache.tables, lo.cuda(), hi.cuda(),
                                 128 ** -0.5, sinks=sinks, window=window, num_splits=splits)
    ref = paged_decode_attention_ref(q.float(), cache.k.float(), cache.v.float(), cache.tables,
                                     lo.cuda(), hi.cuda(), 128 ** -0.5, sinks=sinks,
                                     window=window)
    check("decode_attention", out, ref, tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 256])
def test_prefill_long_chunks(dtype: torch.dtype, window: int | None) -> None:
    gen = torch.Generator().manual_seed(1)
    chunks = [(0, 700), (1200, 512), (50, 1)]
    cache = make_cache(gen, len(chunks), 4, 128, 16, 1712, dtype)
    lens = [n for _, n in chunks]
    starts = torch.tensor([0, 700, 1212], dtype=torch.int32).cuda()
    q = torch.randn(sum(lens), 32, 128, generator=gen).cuda().to(dtype)
    pos0 = torch.tensor([s for s, _ in chunks], dtype=torch.int32).cuda()
    q_len = torch.tensor(lens, dtype=torch.int32).cuda()
    lo = torch.zeros(3, dtype=torch.int32).cuda()
    out = prefill_attention(q, cache.k, cache.v, cache.tables, starts, q_len, pos0, lo,
                            128 ** -0.5, max(lens), window=window, block_m=64, block_n=32)
    ref = prefill_attention_ref(q.float(), cache.k.float(), cache.v.float(), cache.tables,
                                starts, q_len, pos0, lo, 128 ** -0.5, window=window)
    check("prefill_attention", out, ref, tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,max_keys", [(1, 4096), (16, 700)])
def test_mla_decode_deepseek_v3_shapes(dtype: torch.dtype, batch: int, max_keys: int) -> None:
    """DeepSeek-V3's latent attention: 128 heads, a 512-wide latent and a 64-wide rope key."""
    run_mla_case(dtype, heads=128, latent=512, rope=64, num_splits=None, seed=batch,
                 batch=batch, block_size=16, max_keys=max_keys)
