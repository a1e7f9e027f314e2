"""The native paged decode attention kernel against its pure-torch reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer.kernels.cpu.attention import (
    available,
    build_error,
    paged_decode_attention,
    paged_decode_attention_ref,
    takes_cache,
)

pytestmark = pytest.mark.skipif(
    not available(), reason=f"paged attention extension cannot be built: {build_error()}"
)


def make_case(gen: torch.Generator, batch: int, kv_heads: int, group: int, dim: int,
              block_size: int, max_ctx: int = 70, sliding: bool = False,
              index_dtype: torch.dtype = torch.int64):
    """Scattered, non-contiguous block tables over a shared pool; ragged contexts; optional
    sliding lower bounds with the blocks below them freed (-1) as a sliding layer leaves them."""
    max_blocks = -(-max_ctx // block_size)
    num_blocks = batch * max_blocks + 7
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    q = torch.randn(batch, kv_heads * group, dim, generator=gen)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:max_blocks]
                          for _ in range(batch)])
    key_hi = torch.randint(1, max_ctx + 1, (batch,), generator=gen, dtype=torch.int32)
    key_lo = torch.zeros(batch, dtype=torch.int32)
    if sliding:
        window = torch.randint(1, max_ctx, (batch,), generator=gen, dtype=torch.int32)
        key_lo = (key_hi - window).clamp(min=0)
        for b in range(batch):
            tables[b, : int(key_lo[b]) // block_size] = -1
    return q, k_cache, v_cache, tables.to(index_dtype), key_lo, key_hi


def check(case, scale: float | None = None) -> None:
    q, k_cache, v_cache, tables, key_lo, key_hi = case
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = paged_decode_attention(q, k_cache, v_cache, tables, key_lo, key_hi, scale)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, key_lo, key_hi, scale)
    assert out.shape == q.shape and out.dtype == torch.float32
    assert (out - ref).abs().max().item() < 1e-5


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("dim", [16, 64])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("sliding", [False, True])
def test_matches_reference(dim: int, block_size: int, sliding: bool) -> None:
    gen = torch.Generator().manual_seed(1000 * dim + 10 * block_size + sliding)
    for trial in range(6):
        batch = int(torch.randint(1, 6, (1,), generator=gen))
        group = int(torch.randint(1, 4, (1,), generator=gen))
        kv_heads = int(torch.randint(1, 4, (1,), generator=gen))
        index_dtype = torch.int32 if trial % 2 else torch.int64
        check(make_case(gen, batch, kv_heads, group, dim, block_size, sliding=sliding,
                        index_dtype=index_dtype))


@pytest.mark.parametrize("dim", [20, 128])  # the portable tail path, the other unrolled size
def test_other_head_dims(dim: int) -> None:
    gen = torch.Generator().manual_seed(dim)
    check(make_case(gen, 3, 2, 2, dim, 8, sliding=True))


@pytest.mark.parametrize("num_threads", [1, 2])
def test_whole_and_split_rows(threads, num_threads: int) -> None:
    """Many short rows (one task each) and a few long ones split into runs of blocks whose
    partial softmax states are combined, with sliding lower bounds inside a block."""
    threads(num_threads)
    gen = torch.Generator().manual_seed(num_threads)
    check(make_case(gen, 12, 3, 3, 64, 16, max_ctx=200, sliding=True))
    check(make_case(gen, 2, 3, 3, 64, 16, max_ctx=3000, sliding=True))
    check(make_case(gen, 3, 2, 4, 64, 4, max_ctx=900))


def test_long_context_and_scale() -> None:
    gen = torch.Generator().manual_seed(7)
    check(make_case(gen, 2, 1, 2, 64, 16, max_ctx=1500), scale=0.3)


def test_non_contiguous_q_and_empty_rows() -> None:
    gen = torch.Generator().manual_seed(3)
    q, k_cache, v_cache, tables, key_lo, key_hi = make_case(gen, 4, 2, 2, 16, 4)
    q = torch.randn(4, 2 * q.shape[1], 16, generator=gen)[:, ::2]  # a strided view
    key_lo[1] = key_hi[1]  # nothing visible: zeros
    check((q, k_cache, v_cache, tables, key_lo, key_hi))
    out = paged_decode_attention(q, k_cache, v_cache, tables, key_lo, key_hi, 0.25)
    assert out[1].abs().max().item() == 0.0


def test_reference_matches_sdpa() -> None:
    gen = torch.Generator().manual_seed(11)
    q, k_cache, v_cache, tables, key_lo, key_hi = make_case(gen, 3, 2, 3, 16, 4, sliding=True)
    batch, kv_heads, dim = q.shape[0], k_cache.shape[2], q.shape[2]
    k = k_cache[tables.clamp(min=0).reshape(-1)].view(batch, -1, kv_heads, dim).transpose(1, 2)
    v = v_cache[tables.clamp(min=0).reshape(-1)].view(batch, -1, kv_heads, dim).transpose(1, 2)
    pos = torch.arange(k.shape[2])
    mask = ((pos >= key_lo[:, None]) & (pos < key_hi[:, None]))[:, None, None, :]
    sdpa = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=0.25,
                                          enable_gqa=True).squeeze(2)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, key_lo, key_hi, 0.25)
    assert (sdpa - ref).abs().max().item() < 1e-5


def test_rejects_bad_inputs() -> None:
    gen = torch.Generator().manual_seed(5)
    q, k_cache, v_cache, tables, key_lo, key_hi = make_case(gen, 2, 1, 1, 16, 4)
    bad = tables.clone()
    bad[0, (int(key_hi[0]) - 1) // 4] = -1  # a freed block inside the visible range
    with pytest.raises(RuntimeError, match="block id"):
        paged_decode_attention(q, k_cache, v_cache, bad, key_lo, key_hi, 1.0)
    too_far = key_hi.clone()
    too_far[1] = tables.shape[1] * 4 + 1
    with pytest.raises(RuntimeError, match="outside its block table"):
        paged_decode_attention(q, k_cache, v_cache, tables, key_lo, too_far, 1.0)
    with pytest.raises(RuntimeError):
        paged_decode_attention(q.double(), k_cache, v_cache, tables, key_lo, key_hi, 1.0)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [20, 64, 128])
def test_half_caches(threads, cache_dtype: torch.dtype, dim: int) -> None:
    """--kv-cache-dtype float16 / bfloat16: the kernel reads the half cache as float32, so it
    equals the float32 kernel (and the reference) on the same values upcast: exact up to
    summation order, whole and split rows, both head-dim paths and the portable tail."""
    threads(2)
    gen = torch.Generator().manual_seed(dim)
    for case in (make_case(gen, 5, 3, 3, dim, 16, max_ctx=200, sliding=True),
                 make_case(gen, 2, 2, 2, dim, 16, max_ctx=1500)):
        q, k_cache, v_cache, tables, key_lo, key_hi = case
        k_half, v_half = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
        out = paged_decode_attention(q, k_half, v_half, tables, key_lo, key_hi, 0.125)
        ref = paged_decode_attention_ref(q, k_half, v_half, tables, key_lo, key_hi, 0.125)
        upcast = paged_decode_attention(q, k_half.float(), v_half.float(), tables, key_lo,
                                        key_hi, 0.125)
        assert out.dtype == torch.float32
        assert (out - ref).abs().max().item() < 1e-5
        assert (out - upcast).abs().max().item() < 1e-5
        # and the rounding itself is what the cache costs against float32 K/V
        exact = paged_decode_attention_ref(q, k_cache, v_cache, tables, key_lo, key_hi, 0.125)
        assert (out - exact).abs().max().item() < (2e-2 if cache_dtype == torch.bfloat16
                                                   else 3e-3)


def test_rejects_mixed_cache_dtypes() -> None:
    gen = torch.Generator().manual_seed(9)
    q, k_cache, v_cache, tables, key_lo, key_hi = make_case(gen, 2, 1, 1, 16, 4)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        paged_decode_attention(q, k_cache.half(), v_cache.bfloat16(), tables, key_lo, key_hi,
                               1.0)
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        paged_decode_attention(q, k_cache.double(), v_cache.double(), tables, key_lo, key_hi,
                               1.0)


def test_available_checks_tensors() -> None:
    q = torch.zeros(1, 1, 8)
    assert available(q)
    assert not available(q.double())
    assert not available(q, q.to("meta"))
    assert takes_cache(q.half()) and takes_cache(q.bfloat16()) and takes_cache(q)
    assert not takes_cache(q.double()) and not takes_cache(q.to("meta"))
