"""The Triton kernels --deterministic uses on a GPU give each row the same bits whatever else is
in the launch: the fixed-tile linear at any M (across tile boundaries of M, N and K), and paged
decode attention with fixed-size splits at any batch and table width; both still match their
torch references."""

from __future__ import annotations

import torch

from deepinfer.kernels.triton.decode_attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
)
from deepinfer.kernels.triton.matmul import linear_rows, linear_rows_ref
from tests.kernels.triton.device import DEVICE, DTYPES, check, scaled


def test_linear_rows_do_not_depend_on_m():
    gen = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        k, n = 72, 70  # past one BLOCK_K (32) and one BLOCK_N (64)
        w = torch.randn(n, k, generator=gen).to(DEVICE, dtype)
        b = torch.randn(n, generator=gen).to(DEVICE, dtype)
        x = torch.randn(70, k, generator=gen).to(DEVICE, dtype)
        full = linear_rows(x, w, b)
        for m in (1, 3, 33, 40):
            part = linear_rows(x[-m:], w, b)  # the same rows, at other places in their tiles
            assert torch.equal(part, full[-m:]), (dtype, m)
        ref = linear_rows_ref(x, w, b)
        check("linear_rows", full, ref, scaled(dtype, ref))


def launch(q0: torch.Tensor, hi0: int, rows: int, width: int, k_cache, v_cache, seed: int):
    """Row 0: q0 over keys [0, hi0) of blocks 0..; others random, tables `width` blocks."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks, block_size = k_cache.shape[:2]
    q = torch.randn(rows, *q0.shape, generator=gen).to(DEVICE, q0.dtype)
    q[0] = q0
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width]
                          for _ in range(rows)]).to(torch.int32)
    tables[0] = torch.arange(width, dtype=torch.int32)
    hi = torch.randint(1, width * block_size + 1, (rows,), generator=gen, dtype=torch.int32)
    hi[0] = hi0
    lo = torch.zeros(rows, dtype=torch.int32)
    return q, tables.to(DEVICE), lo.to(DEVICE), hi.to(DEVICE)


def test_decode_attention_with_fixed_splits_does_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(1)
    for dtype in DTYPES:
        num_blocks, block_size, kv_heads, group, dim = 24, 4, 2, 2, 16
        k = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(DEVICE, dtype)
        v = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(DEVICE, dtype)
        q0 = torch.randn(kv_heads * group, dim, generator=gen).to(DEVICE, dtype)
        hi0 = 41  # three splits of 16 keys, the last one partial
        outs = []
        for rows, width in ((1, 11), (3, 11), (5, 24)):  # a wider table: more (empty) splits
            args = launch(q0, hi0, rows, width, k, v, seed=rows)
            outs.append(paged_decode_attention(args[0], k, v, *args[1:], 0.25, block_n=16,
                                               keys_per_split=16)[0])
        assert all(torch.equal(o, outs[0]) for o in outs), dtype
        q, tables, lo, hi = launch(q0, hi0, 1, 11, k, v, seed=0)
        ref = paged_decode_attention_ref(q, k, v, tables, lo, hi, 0.25)[0]
        check("decode_attention", outs[0], ref, scaled(dtype, ref))


def test_the_backend_gives_a_query_the_same_bits_in_any_chunk_and_batch():
    """TritonAttention with row_invariant: positions 8..19 of one sequence computed as one
    chunk alone, and as two chunks each beside other sequences (a decode, another prompt),
    give each query the same output (every token a decode row with fixed splits); and what
    the torch backend computes."""
    import numpy as np

    from deepinfer.workers.attention import SeqSlice
    from deepinfer.workers.attention.torch_backend import TorchAttention
    from deepinfer.workers.attention.triton_backend import TritonAttention

    gen = torch.Generator().manual_seed(3)
    bs, kv_heads, heads, dim, num_blocks = 4, 2, 4, 16, 40
    k_cache = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen)
    table = np.arange(5, dtype=np.int32)  # positions 0..19
    others = [SeqSlice(np.arange(10, 20, dtype=np.int32), 30, 1),
              SeqSlice(np.arange(20, 30, dtype=np.int32), 0, 9)]
    q_all = torch.randn(20, heads, dim, generator=gen)
    backend = TritonAttention(DEVICE)
    backend.row_invariant = True

    def attend(slices, queries):
        meta = backend.build_metadata(slices, bs, None)
        q = torch.cat(queries).to(DEVICE)
        kv = torch.zeros(q.shape[0], kv_heads, dim, device=DEVICE)  # already in the cache
        return backend.forward(q, kv, kv, k_cache.to(DEVICE), v_cache.to(DEVICE), meta, 0.25)

    other_q = [torch.randn(1, heads, dim, generator=gen), torch.randn(9, heads, dim, generator=gen)]
    whole = attend([SeqSlice(table, 8, 12, write_from=20)], [q_all[8:20]])
    first = attend([others[0], SeqSlice(table, 8, 6, write_from=20)], [other_q[0], q_all[8:14]])
    second = attend([SeqSlice(table, 14, 6, write_from=20), others[1]], [q_all[14:20], other_q[1]])
    assert torch.equal(torch.cat([first[1:], second[:6]]), whole)
    torch_backend, kv = TorchAttention(), torch.zeros(12, kv_heads, dim)
    meta = torch_backend.build_metadata([SeqSlice(table, 8, 12, write_from=20)], bs, None)
    ref = torch_backend.forward(q_all[8:20], kv, kv, k_cache, v_cache, meta, 0.25)
    check("attention backend", whole, ref, 1e-4)
