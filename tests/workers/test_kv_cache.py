"""workers/kv_cache.py: one (K, V) pair per cache entry, shaped by its layout."""

from __future__ import annotations

import torch

from deepinfer.engine.kv_layout import FULL, LATENT, SLIDING, VECTOR, LayerKVLayout
from deepinfer.workers.distributed.parallel_state import ParallelState
from deepinfer.workers.kv_cache import KVCache


def test_pairs_follow_the_layouts_and_the_ranks_share_of_heads() -> None:
    layers = [LayerKVLayout(FULL, 4, 8), LayerKVLayout(SLIDING, 4, 8, window=16),
              LayerKVLayout(FULL, 1, 32, entry=LATENT, rope_dim=6),
              LayerKVLayout(FULL, 1, 5, entry=VECTOR)]
    cache = KVCache(layers, 10, 4, torch.float16)
    assert len(cache) == 4 and cache[0] is cache.pairs[0]
    assert [(tuple(k.shape), tuple(v.shape)) for k, v in cache] == [
        ((10, 4, 4, 8), (10, 4, 4, 8)), ((10, 4, 4, 8), (10, 4, 4, 8)),
        ((10, 4, 1, 6), (10, 4, 1, 32)), ((10, 4, 1, 5), (10, 4, 1, 0))]
    assert {t.dtype for pair in cache for t in pair} == {torch.float16}
    assert [id(p) for p in cache.full_attention()] == [id(cache[i]) for i in (0, 2, 3)]
    # Tensor parallelism splits KV heads only (rank 1 of 3 keeps 1 of 4: 2, 1, 1).
    shard = KVCache(layers, 10, 4, torch.float32, shard=ParallelState(1, 3))
    assert [tuple(k.shape[2:]) for k, _ in shard] == [(1, 8), (1, 8), (1, 6), (1, 5)]
