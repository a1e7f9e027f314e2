"""Paged decode attention (GQA, windows, sinks, split-KV) against the torch references."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.cpu.attention import paged_decode_attention_ref as cpu_ref
from deepinfer.kernels.triton.decode_attention import (
    default_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from tests.kernels.triton.device import DEVICE, DTYPES, check, tolerance
from tests.kernels.triton.paged_cases import free_below, make_cache


def run_case(dtype: torch.dtype, batch: int, kv_heads: int, group: int, dim: int,
             block_size: int, max_keys: int, seed: int, window: int | None = None,
             window_in_lo: bool = False, with_sinks: bool = False,
             num_splits: int | None = None) -> float:
    gen = torch.Generator().manual_seed(seed)
    cache = make_cache(gen, batch, kv_heads, dim, block_size, max_keys, dtype)
    heads = kv_heads * group
    q = torch.randn(batch, heads, dim, generator=gen).to(DEVICE, dtype)
    key_hi = torch.randint(1, max_keys + 1, (batch,), generator=gen, dtype=torch.int32)
    key_hi[0] = max_keys  # one full row
    key_lo = torch.zeros(batch, dtype=torch.int32)
    if window is not None:
        for b in range(batch):
            free_below(cache, b, max(0, int(key_hi[b]) - window))
        if window_in_lo:  # as the metadata passes it
            key_lo = (key_hi - window).clamp(min=0)
    sinks = (torch.randn(heads, generator=gen) * 2).to(DEVICE) if with_sinks else None
    kernel_window = None if window_in_lo else window
    scale = dim ** -0.5
    args = (q, cache.k, cache.v, cache.tables, key_lo.to(DEVICE), key_hi.to(DEVICE), scale)
    out = paged_decode_attention(*args, sinks=sinks, window=kernel_window,
                                 num_splits=num_splits, block_n=16)
    cpu_args = [t.cpu().float() if t.is_floating_point() else t.cpu() for t in args[:6]]
    ref = paged_decode_attention_ref(*cpu_args, scale,
                                     sinks=None if sinks is None else sinks.cpu(),
                                     window=kernel_window)
    assert out.dtype == dtype
    return check("decode_attention", out, ref, tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (2, 4), (1, 3)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_gqa_and_splits(dtype: torch.dtype, kv_heads: int, group: int, num_splits: int) -> None:
    run_case(dtype, batch=3, kv_heads=kv_heads, group=group, dim=16, block_size=4,
             max_keys=37, seed=kv_heads * 10 + group, num_splits=num_splits)


@pytest.mark.parametrize("window_in_lo", [False, True])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_sliding_window_with_freed_blocks(window_in_lo: bool, num_splits: int) -> None:
    run_case(torch.float32, batch=3, kv_heads=2, group=2, dim=16, block_size=4, max_keys=45,
             seed=7, window=10, window_in_lo=window_in_lo, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_sinks(num_splits: int) -> None:
    run_case(torch.float32, batch=2, kv_heads=2, group=2, dim=32, block_size=8, max_keys=30,
             seed=3, with_sinks=True, window=12, num_splits=num_splits)


def test_more_splits_than_keys_and_default_heuristic() -> None:
    run_case(torch.float32, batch=2, kv_heads=1, group=2, dim=24, block_size=4, max_keys=9,
             seed=5, num_splits=8)  # odd dim, empty splits
    run_case(torch.float32, batch=1, kv_heads=2, group=2, dim=16, block_size=16, max_keys=40,
             seed=6, with_sinks=True)
    assert default_num_splits(1, 8, 32768) > 1
    assert default_num_splits(256, 8, 32768) == 1
    assert default_num_splits(1, 8, 100) == 1


def test_empty_rows_give_zeros_and_sinks_do_not_leak() -> None:
    gen = torch.Generator().manual_seed(11)
    cache = make_cache(gen, 2, 1, 16, 4, 8, torch.float32)
    q = torch.randn(2, 2, 16, generator=gen).to(DEVICE)
    lo = torch.tensor([3, 0], dtype=torch.int32, device=DEVICE)
    hi = torch.tensor([3, 5], dtype=torch.int32, device=DEVICE)
    sinks = torch.ones(2, device=DEVICE)
    out = paged_decode_attention(q, cache.k, cache.v, cache.tables, lo, hi, 0.25, sinks=sinks,
                                 num_splits=2)
    assert torch.equal(out[0].cpu(), torch.zeros(2, 16))
    assert out[1].abs().sum() > 0


def test_reference_matches_the_cpu_reference() -> None:
    """Without sinks, the row-by-row reference is the CPU path's reference."""
    gen = torch.Generator().manual_seed(2)
    cache = make_cache(gen, 3, 2, 16, 4, 21, torch.float32)
    tables, k, v = cache.tables.cpu(), cache.k.cpu(), cache.v.cpu()
    q = torch.randn(3, 4, 16, generator=gen)
    lo = torch.tensor([0, 5, 2], dtype=torch.int32)
    hi = torch.tensor([21, 9, 13], dtype=torch.int32)
    ours = paged_decode_attention_ref(q, k, v, tables, lo, hi, 0.3)
    theirs = cpu_ref(q, k, v, tables, lo, hi, 0.3)
    assert (ours - theirs).abs().max().item() < 1e-5
