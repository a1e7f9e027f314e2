"""Prefill attention over the paged cache (varlen, causal, sliding, sinks) against torch."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.triton.prefill_attention import prefill_attention, prefill_attention_ref
from tests.kernels.triton.device import DEVICE, DTYPES, check, tolerance
from tests.kernels.triton.paged_cases import free_below, make_cache


def run_case(dtype: torch.dtype, chunks: list[tuple[int, int]], kv_heads: int, group: int,
             dim: int, block_size: int, seed: int, window: int | None = None,
             key_lo: list[int] | None = None, with_sinks: bool = False) -> float:
    """chunks: (first position, number of new tokens) per sequence."""
    gen = torch.Generator().manual_seed(seed)
    max_keys = max(start + n for start, n in chunks)
    cache = make_cache(gen, len(chunks), kv_heads, dim, block_size, max_keys, dtype)
    heads = kv_heads * group
    lens = [n for _, n in chunks]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), heads, dim, generator=gen).to(DEVICE, dtype)
    pos0 = torch.tensor([start for start, _ in chunks], dtype=torch.int32)
    lo = torch.tensor(key_lo or [0] * len(chunks), dtype=torch.int32)
    if window is not None:  # blocks no query of the chunk can see are freed
        for s, (start, _) in enumerate(chunks):
            free_below(cache, s, max(0, start - window + 1))
    sinks = (torch.randn(heads, generator=gen) * 2).to(DEVICE) if with_sinks else None
    scale = dim ** -0.5
    starts, q_len = cu[:-1].clone(), torch.tensor(lens, dtype=torch.int32)
    out = prefill_attention(q, cache.k, cache.v, cache.tables, starts.to(DEVICE),
                            q_len.to(DEVICE), pos0.to(DEVICE), lo.to(DEVICE), scale, max(lens),
                            window=window, sinks=sinks)
    ref = prefill_attention_ref(q.cpu().float(), cache.k.cpu().float(), cache.v.cpu().float(),
                                cache.tables.cpu(), starts, q_len, pos0, lo, scale, window=window,
                                sinks=None if sinks is None else sinks.cpu())
    assert out.dtype == dtype
    return check("prefill_attention", out, ref, tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (1, 4)])
def test_varlen_causal_gqa(dtype: torch.dtype, kv_heads: int, group: int) -> None:
    # a fresh prompt, a later chunk over cached context, a one-token chunk, an odd one
    chunks = [(0, 21), (13, 8), (30, 1), (5, 17)]
    run_case(dtype, chunks, kv_heads, group, dim=16, block_size=4, seed=group)


def test_odd_dim_and_block_size_above_tile() -> None:
    run_case(torch.float32, [(0, 9), (19, 5)], kv_heads=2, group=2, dim=24, block_size=32,
             seed=4)


@pytest.mark.parametrize("window", [1, 6, 40])
def test_sliding_window_with_freed_blocks(window: int) -> None:
    run_case(torch.float32, [(0, 20), (25, 11), (9, 3)], kv_heads=2, group=2, dim=16,
             block_size=4, seed=window, window=window)


def test_replay_start_and_sinks() -> None:
    # key_lo: keys below it were never computed (SWA replay); a row may then see nothing
    run_case(torch.float32, [(10, 6), (0, 12)], kv_heads=1, group=2, dim=16, block_size=8,
             seed=9, key_lo=[12, 0], with_sinks=True, window=8)
