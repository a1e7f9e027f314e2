"""The KV cache spec: what each layer keeps per token in the paged cache.

The scheduler's block groups and the workers' cache tensors both derive from it, so a new
attention kind (a latent cache, compressed entries, indexer keys) is a new kind of layer spec,
not edits across the engine. Layers whose specs agree on kind and window share a block group:
one block pool and one block table per request. No torch: every process reads it.
"""

from __future__ import annotations

import msgspec

FULL = "full"  # every token's K and V, for the whole sequence
SLIDING = "sliding"  # K and V of the last `window` tokens only

# What one token holds (independent of how long it is kept, which the kind says):
KV = "kv"  # a key and a value per KV head
LATENT = "latent"  # MLA (DeepSeek): one compressed latent and one shared rotary key


class LayerKVSpec(msgspec.Struct, frozen=True):
    kind: str
    num_kv_heads: int
    head_dim: int  # LATENT: the latent's width (kv_lora_rank)
    window: int | None = None  # SLIDING: how many tokens back a query sees (itself included)
    entry: str = KV
    rope_dim: int = 0  # LATENT: the shared rotary key's width

    def entry_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """The shape one token occupies in each of the layer's two cache tensors: K and V, or
        (LATENT) the rotary key and the latent."""
        if self.entry == LATENT:
            return (1, self.rope_dim), (1, self.head_dim)
        return (self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim)

    def bytes_per_token(self, dtype_bytes: int) -> int:
        return sum(h * d for h, d in self.entry_shapes()) * dtype_bytes


class KVGroup(msgspec.Struct, frozen=True):
    """Layers that share a block pool and a block table per request."""

    kind: str = FULL
    window: int | None = None
    layers: tuple[int, ...] = ()


class KVCacheSpec(msgspec.Struct, frozen=True):
    layers: tuple[LayerKVSpec, ...]

    def groups(self) -> tuple[KVGroup, ...]:
        """Block groups in a fixed order: full attention first, then sliding windows."""
        keys = sorted({(s.kind != FULL, s.window or 0, s.kind) for s in self.layers})
        return tuple(
            KVGroup(kind, window or None,
                    tuple(i for i, s in enumerate(self.layers)
                          if s.kind == kind and (s.window or 0) == window))
            for _, window, kind in keys)

    def group_of(self, layer: int) -> int:
        return next(g for g, group in enumerate(self.groups()) if layer in group.layers)

    def layers_of(self, kind: str) -> list[int]:
        return [i for i, s in enumerate(self.layers) if s.kind == kind]

    def bytes_per_token(self, dtype_bytes: int, layers: list[int] | None = None) -> int:
        """K and V bytes of one token over `layers` (default: every layer)."""
        picked = range(len(self.layers)) if layers is None else layers
        return sum(self.layers[i].bytes_per_token(dtype_bytes) for i in picked)
