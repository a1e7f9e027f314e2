"""Paged decode attention: the native kernel and the gather + SDPA fallback against a naive
reference over the same cache, with sliding windows, replay lower bounds and freed blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.kernels.cpu import attention as cpu_attention
from deepinfer.workers.attention import AttentionMetadata, SeqSlice
from deepinfer.workers.attention.cpu_backend import CpuAttention
from deepinfer.workers.attention.torch_backend import TorchAttention


def naive(q, k_all, v_all, lo, hi, scale):
    """q [H, D]; k_all/v_all [positions, KVH, D]; keys lo..hi-1."""
    g = q.shape[0] // k_all.shape[1]
    k = k_all[lo:hi].repeat_interleave(g, dim=1).transpose(0, 1)  # [H, L, D]
    v = v_all[lo:hi].repeat_interleave(g, dim=1).transpose(0, 1)
    p = torch.softmax((q[:, None, :] * scale * k).sum(-1), dim=-1)  # [H, L]
    return (p[:, :, None] * v).sum(1)


@pytest.mark.parametrize("backend", [CpuAttention, TorchAttention])
@pytest.mark.parametrize("window", [None, 5])
def test_decode_matches_naive_reference(backend, window):
    if backend is CpuAttention and not cpu_attention.available():
        pytest.fail(f"native kernel did not build: {cpu_attention.build_error()}")
    torch.manual_seed(0)
    bs, kvh, heads, dim, nblocks = 4, 2, 4, 16, 40
    k_cache = torch.randn(nblocks, bs, kvh, dim)
    v_cache = torch.randn(nblocks, bs, kvh, dim)
    rng = np.random.default_rng(0)
    free = list(rng.permutation(nblocks))
    rows = []  # (table, position of the new token, key_from)
    for pos, key_from in ((9, 0), (17, 0), (3, 0), (22, 12)):
        table = np.array([free.pop() for _ in range(pos // bs + 1)], dtype=np.int32)
        if window is not None:  # blocks wholly outside the window were freed
            table[: max(0, pos - window + 1) // bs] = -1
        rows.append((table, pos, key_from))
    slices = [SeqSlice(t, p, 1, key_from=kf) for t, p, kf in rows]
    meta = AttentionMetadata.build(slices, bs, window)
    q = torch.randn(len(rows), heads, dim)
    k_new, v_new = torch.randn(len(rows), kvh, dim), torch.randn(len(rows), kvh, dim)
    out = backend().forward(q, k_new, v_new, k_cache, v_cache, meta, dim**-0.5)
    for i, (table, pos, key_from) in enumerate(rows):
        blocks = torch.from_numpy(np.maximum(table, 0).astype(np.int64))
        k_all = k_cache[blocks].reshape(-1, kvh, dim)
        v_all = v_cache[blocks].reshape(-1, kvh, dim)
        lo = max(key_from, 0 if window is None else pos - window + 1)
        ref = naive(q[i], k_all, v_all, lo, pos + 1, dim**-0.5)
        assert torch.allclose(out[i], ref, atol=1e-5), i
