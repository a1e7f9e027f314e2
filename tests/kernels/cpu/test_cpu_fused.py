"""The fused element-wise ops (norm + residual, rotary + KV store, silu * up) against torch."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.cpu import fused as cpu_fused

pytestmark = pytest.mark.skipif(
    not cpu_fused.available(), reason=f"fused ops cannot be built: {cpu_fused.build_error()}"
)


@pytest.mark.parametrize("rows,n", [(1, 576), (37, 576), (300, 64), (3, 17)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(rows: int, n: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, n, generator=gen) * 3
    residual = torch.randn(rows, n, generator=gen) if with_residual else None
    weight = torch.randn(n, generator=gen)
    res_native = residual.clone() if with_residual else None
    res_ref = residual.clone() if with_residual else None
    out = cpu_fused.add_rms_norm(x, res_native, weight, 1e-5)
    ref = cpu_fused.add_rms_norm_ref(x.clone(), res_ref, weight, 1e-5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if with_residual:
        torch.testing.assert_close(res_native, residual + x)
    # and the reference is the textbook formula
    src = x + residual if with_residual else x
    textbook = weight * src * torch.rsqrt(src.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(ref, textbook, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,n", [(1, 1536), (64, 1536), (5, 7)])
def test_silu_and_mul(rows: int, n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(rows, 2 * n, generator=gen) * 5  # both tails of the sigmoid
    x[0, 0], x[0, 1] = 90.0, -90.0  # exp would overflow a naive formula
    out = cpu_fused.silu_and_mul(x)
    gate, up = x[:, :n], x[:, n:]
    torch.testing.assert_close(out, gate * torch.sigmoid(gate) * up, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu_fused.silu_and_mul_ref(x), out, rtol=1e-5, atol=1e-5)


def split_qkv(qkv: torch.Tensor, heads: int, kv_heads: int, dim: int):
    """Views into a fused qkv output, as the model has them (strided rows)."""
    t = qkv.shape[0]
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return q.view(t, heads, dim), k.view(t, kv_heads, dim), v.view(t, kv_heads, dim)


@pytest.mark.parametrize("tokens", [1, 9, 200])
@pytest.mark.parametrize("store", [False, True])
def test_rope_store_kv(tokens: int, store: bool) -> None:
    heads, kv_heads, dim, block_size, num_blocks = 6, 2, 16, 4, 80
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    freqs = torch.outer(torch.arange(512).float(), torch.rand(dim // 2, generator=gen))
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    caches = [torch.zeros(num_blocks, block_size, kv_heads, dim) for _ in range(4)]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::3] = -1  # rows whose K/V the cache already holds
    outs = []
    for fn, (kc, vc) in ((cpu_fused.rope_store_kv, caches[:2]),
                         (cpu_fused.rope_store_kv_ref, caches[2:])):
        buf = qkv.clone()
        q, k, v = split_qkv(buf, heads, kv_heads, dim)
        if store:
            fn(q, k, v, cos, sin, positions, kc, vc, slots)
        else:
            fn(q, k, v, cos, sin, positions)
        outs.append((buf, kc, vc))
    (buf, kc, vc), (buf_ref, kc_ref, vc_ref) = outs
    torch.testing.assert_close(buf, buf_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kc, kc_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vc, vc_ref)
    # the rotation itself, by the HF formula on one head
    q0 = qkv[:, :dim]
    half = dim // 2
    rotated = torch.cat([-q0[:, half:], q0[:, :half]], dim=-1)
    hf = q0 * cos[positions] + rotated * sin[positions]
    torch.testing.assert_close(buf[:, :dim], hf, rtol=1e-5, atol=1e-5)
    if store:
        written = slots >= 0
        k_rows = kc.view(-1, kv_heads * dim)[slots[written]]
        torch.testing.assert_close(k_rows, buf[written, heads * dim:(heads + kv_heads) * dim])
        assert int((kc != 0).any(-1).any(-1).sum()) == int(written.sum())


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_rope_store_kv_half_cache(cache_dtype: torch.dtype) -> None:
    """A float16 / bfloat16 cache (--kv-cache-dtype) holds the rotated k and v rounded to
    nearest even, as torch's .to() rounds them: the native op equals the reference bit for bit."""
    heads, kv_heads, dim, block_size, num_blocks = 6, 2, 24, 4, 40
    gen = torch.Generator().manual_seed(3)
    tokens = 37
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 30
    freqs = torch.outer(torch.arange(256).float(), torch.rand(dim // 2, generator=gen))
    emb = torch.cat([freqs, freqs], dim=-1)
    positions = torch.randint(0, 256, (tokens,), generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::4] = -1
    outs = []
    for fn in (cpu_fused.rope_store_kv, cpu_fused.rope_store_kv_ref):
        kc, vc = (torch.zeros(num_blocks, block_size, kv_heads, dim, dtype=cache_dtype)
                  for _ in range(2))
        buf = qkv.clone()
        q, k, v = split_qkv(buf, heads, kv_heads, dim)
        fn(q, k, v, emb.cos(), emb.sin(), positions, kc, vc, slots)
        outs.append((buf, kc, vc))
    (buf, kc, vc), (buf_ref, kc_ref, vc_ref) = outs
    torch.testing.assert_close(buf, buf_ref, rtol=1e-5, atol=1e-4)
    assert torch.equal(vc, vc_ref)  # v is stored as it came: the same rounding exactly
    written = slots >= 0
    k_rows = kc.view(-1, kv_heads * dim)[slots[written]]
    expected = buf[written, heads * dim:(heads + kv_heads) * dim].to(cache_dtype)
    assert torch.equal(k_rows, expected)
    torch.testing.assert_close(kc.float(), kc_ref.float(), rtol=1e-2, atol=1e-3)


def test_rejects_bad_inputs() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight"):
        cpu_fused.add_rms_norm(x, None, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="2 \\* n"):
        cpu_fused.silu_and_mul(torch.randn(4, 7))
    qkv = torch.randn(2, 4 * 8)
    q, k, v = split_qkv(qkv, 2, 1, 8)
    table = torch.zeros(10, 8)
    with pytest.raises(RuntimeError, match="position"):
        cpu_fused.rope_store_kv(q, k, v, table, table, torch.tensor([0, 10]))
    cache = torch.zeros(2, 2, 1, 8)
    with pytest.raises(RuntimeError, match="slot"):
        cpu_fused.rope_store_kv(q, k, v, table, table, torch.tensor([0, 1]), cache, cache.clone(),
                                torch.tensor([0, 4]))
