"""The Triton attention backend (workers/attention/triton_backend.py) behind the attention seam
gives what the torch backend gives, from the same slices: a step mixing decodes, verify rows,
fresh prompts, later chunks and a sliding-window replay, and a decode-only step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.workers.attention import AttentionMetadata, SeqSlice, select_backend
from deepinfer.workers.attention.torch_backend import TorchAttention
from deepinfer.workers.attention.triton_backend import TritonAttention, TritonMetadata
from tests.kernels.triton.device import DEVICE, check

PLANS = {  # (start, new tokens, verify, key_from, write_from) per seq
    "mixed": [(9, 1, False, 0, 0), (14, 3, True, 0, 0), (0, 7, False, 0, 0),
              (8, 6, False, 0, 0), (10, 5, False, 6, 12), (21, 1, False, 0, 0)],
    "decode only": [(9, 1, False, 0, 0), (30, 1, False, 0, 0), (3, 1, False, 0, 0)],
}


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("plan_name", list(PLANS))
def test_step_matches_torch_backend(window: int | None, plan_name: str) -> None:
    gen = torch.Generator().manual_seed(0)
    bs, kv_heads, heads, dim, num_blocks = 4, 2, 4, 16, 48
    rng = np.random.default_rng(0)
    free = list(rng.permutation(num_blocks))
    plan = PLANS[plan_name]
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
    backend = TritonAttention(DEVICE)
    own = backend.build_metadata(slices, bs, window)
    assert isinstance(own, TritonMetadata) and own.row_slots.device.type == DEVICE
    args = (q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE))
    check("attention backend", backend.forward(*args, own, scale), ref, 1e-4)
    # Metadata another backend built (host tensors) is rebuilt for the device first.
    check("attention backend", backend.forward(*args, meta, scale), ref, 1e-4)


def test_cuda_devices_select_the_triton_backend() -> None:
    """Chosen by device type alone: no CUDA call is made to choose it."""
    backend = select_backend("cuda:1", torch.float16)
    assert isinstance(backend, TritonAttention) and backend.device == torch.device("cuda:1")
    assert not isinstance(select_backend("cpu", torch.float32), TritonAttention)


@pytest.mark.parametrize("plan_name", list(PLANS))
def test_mla_with_triton_metadata_matches_torch(plan_name: str, monkeypatch) -> None:
    """workers/attention/mla.py: with the Triton backend's metadata, the decode rows attend
    through kernels/triton/mla_decode.py; the result is the torch path's (prefill chunks take
    the same expanded path under either)."""
    from deepinfer.kernels.triton import mla_decode
    from deepinfer.workers.attention.mla import mla_attention

    launches = []
    kernel = mla_decode.mla_decode_attention
    monkeypatch.setattr(mla_decode, "mla_decode_attention",
                        lambda *a, **k: launches.append(a[0].shape) or kernel(*a, **k))

    gen = torch.Generator().manual_seed(1)
    bs, heads, nope, rope, latent, v_dim, num_blocks = 4, 3, 8, 16, 32, 8, 48
    rng = np.random.default_rng(1)
    free = list(rng.permutation(num_blocks))
    slices = [SeqSlice(np.array([free.pop() for _ in range((start + n - 1) // bs + 1)],
                                dtype=np.int32), start, n, write_from=write_from,
                       key_from=key_from, verify=verify)
              for start, n, verify, key_from, write_from in PLANS[plan_name]]
    meta = AttentionMetadata.build(slices, bs, None)
    tokens = sum(s.num_tokens for s in slices)
    rope_cache = torch.randn(num_blocks, bs, 1, rope, generator=gen)
    latent_cache = torch.randn(num_blocks, bs, 1, latent, generator=gen)
    q_nope = torch.randn(tokens, heads, nope, generator=gen)
    q_rope = torch.randn(tokens, heads, rope, generator=gen)
    kv_b = torch.randn(heads * (nope + v_dim), latent, generator=gen) * 0.2
    scale = (nope + rope) ** -0.5
    ref = mla_attention(q_nope, q_rope, rope_cache, latent_cache, meta, kv_b, v_dim, scale)
    own = TritonAttention(DEVICE).build_metadata(slices, bs, None)
    out = mla_attention(*(t.to(DEVICE) for t in (q_nope, q_rope, rope_cache, latent_cache)),
                        own, kv_b.to(DEVICE), v_dim, scale)
    check("mla backend", out, ref, 1e-4)
    assert launches == [(len(meta.decode_rows), heads, latent)]  # one launch, every decode row
