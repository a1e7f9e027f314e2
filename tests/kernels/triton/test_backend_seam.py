"""The Triton attention kernels fed from the attention backends' own metadata
(workers/attention/metadata.py) give what the torch backend gives: the inputs a Triton backend
behind that seam would pass, on a step mixing decodes, verify rows, fresh prompts, later chunks
and a sliding-window replay."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.triton.decode_attention import paged_decode_attention
from kernels.triton.prefill_attention import prefill_attention
from tests.kernels.triton.device import DEVICE, check
from workers.attention import AttentionMetadata, SeqSlice
from workers.attention.torch_backend import TorchAttention


def triton_forward(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """What a Triton backend's forward does with the metadata (moved to the device)."""
    dev = q.device
    out = torch.empty_like(q)
    if meta.decode_rows is not None:
        rows = meta.decode_rows.to(dev)
        out[rows] = paged_decode_attention(
            q[rows], k_cache, v_cache, meta.decode_blocks.view(len(rows), -1).to(dev),
            meta.decode_lo.to(dev), meta.decode_hi.to(dev), scale)
    if meta.prefills:
        ps = meta.prefills
        tables = torch.full((len(ps), max(len(p.blocks) for p in ps)), -1, dtype=torch.int32)
        for i, p in enumerate(ps):
            tables[i, : len(p.blocks)] = p.blocks
        ints = lambda xs: torch.tensor(xs, dtype=torch.int32, device=dev)  # noqa: E731
        prefill_attention(
            q, k_cache, v_cache, tables.to(dev), ints([p.start for p in ps]),
            ints([p.end - p.start for p in ps]), ints([p.start_pos - p.first_key for p in ps]),
            ints([max(p.key_from - p.first_key, 0) for p in ps]), scale,
            max(p.end - p.start for p in ps), window=meta.window, out=out)
    return out


@pytest.mark.parametrize("window", [None, 5])
def test_mixed_step_matches_torch_backend(window: int | None) -> None:
    gen = torch.Generator().manual_seed(0)
    bs, kv_heads, heads, dim, num_blocks = 4, 2, 4, 16, 48
    rng = np.random.default_rng(0)
    free = list(rng.permutation(num_blocks))
    # (start, new tokens, verify, key_from, write_from)
    plan = [(9, 1, False, 0, 0), (14, 3, True, 0, 0), (0, 7, False, 0, 0),
            (8, 6, False, 0, 0), (10, 5, False, 6, 12), (21, 1, False, 0, 0)]
    slices = []
    for start, n, verify, key_from, write_from in plan:
        table = np.array([free.pop() for _ in range((start + n - 1) // bs + 1)], dtype=np.int32)
        if window is not None:  # blocks wholly outside every query's window were freed
            table[: max(0, max(start, key_from) - window + 1) // bs] = -1
        slices.append(SeqSlice(table, start, n, write_from=write_from, key_from=key_from,
                               verify=verify))
    meta = AttentionMetadata.build(slices, bs, window)
    tokens = sum(n for _, n, *_ in plan)
    k_cache = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen)
    q = torch.randn(tokens, heads, dim, generator=gen)
    k = torch.randn(tokens, kv_heads, dim, generator=gen)
    v = torch.randn(tokens, kv_heads, dim, generator=gen)
    written = (meta.row_slots >= 0).nonzero().squeeze(1)  # the step's K/V, as rotary stores it
    k_cache.view(-1, kv_heads, dim)[meta.row_slots[written]] = k[written]
    v_cache.view(-1, kv_heads, dim)[meta.row_slots[written]] = v[written]
    scale = dim ** -0.5
    ref = TorchAttention().forward(q, k, v, k_cache, v_cache, meta, scale)
    out = triton_forward(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), meta, scale)
    check("attention via metadata", out, ref, 1e-4)
