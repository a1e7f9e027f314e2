"""One model's paged KV cache: a (K, V) pair of tensors per cache entry, shaped by its layout.

The target model, a draft model and the MTP layer each keep one, all indexed by the same block
ids (a slot is block * block_size + offset): the scheduler reserves blocks once for all of them.
What a token takes in each tensor comes from engine/kv_layout.py (K and V, a latent and its
rotary key, one vector); with tensor parallelism a rank keeps only its share of the KV heads.
The host tier (workers/kv_connectors/host_tier.py) mirrors the full-attention pairs of every
holder.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from deepinfer.engine.kv_layout import FULL, KV, LayerKVLayout
from deepinfer.workers.distributed.parallel_state import ParallelState

KVPair = tuple[torch.Tensor, torch.Tensor]


class KVCache(Sequence[KVPair]):
    """Entry i's (K, V) pair is `cache[i]`: models take the cache as their list of pairs."""

    def __init__(self, layers: Sequence[LayerKVLayout], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu",
                 shard: ParallelState | None = None) -> None:
        """`shard`: the tensor-parallel rank whose share of each KV entry's heads this holds
        (default: all of them)."""
        self.layers = tuple(layers)
        self.block_size = block_size
        shard = shard or ParallelState()
        self.pairs: list[KVPair] = [self._pair(layer, num_blocks, dtype, device, shard)
                                    for layer in self.layers]

    def _pair(self, layer: LayerKVLayout, blocks: int, dtype: torch.dtype,
              device: torch.device | str, shard: ParallelState) -> KVPair:
        k, v = layer.entry_shapes()
        if layer.entry == KV and shard.world > 1:
            heads = shard.kv_heads(layer.num_kv_heads)[1]
            k, v = (heads, k[1]), (heads, v[1])
        return (torch.zeros((blocks, self.block_size, *k), dtype=dtype, device=device),
                torch.zeros((blocks, self.block_size, *v), dtype=dtype, device=device))

    def full_attention(self) -> list[KVPair]:
        """The pairs of full-attention entries: what the host tier keeps copies of."""
        return self.of_kind(FULL)

    def of_kind(self, kind: str) -> list[KVPair]:
        """The pairs of the entries of one kind (engine/kv_layout.py: FULL, SLIDING)."""
        return [pair for pair, layer in zip(self.pairs, self.layers) if layer.kind == kind]

    def __getitem__(self, i):  # (an int or a slice, as a list's)
        return self.pairs[i]

    def __iter__(self) -> Iterator[KVPair]:  # (the list's: models walk it every forward)
        return iter(self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)
