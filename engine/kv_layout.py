"""The KV cache layout: what each layer keeps per token in the paged cache.

The scheduler's block groups and the workers' cache tensors both derive from it, so a new
attention kind (a latent cache, compressed entries, indexer keys) is a new kind of layer layout,
not edits across the engine. Cache entries whose layouts agree on kind and window share a block
group: one block pool and one block table per request. A decoder layer usually has one entry;
DeepSeek-V4's have several (its window, compressed entries, indexer keys and the compressors'
per-token inputs), each an entry of its own with `layer` naming the decoder layer. No torch:
every process reads it.
"""

from __future__ import annotations

import msgspec

FULL = "full"  # every token's K and V, for the whole sequence
SLIDING = "sliding"  # K and V of the last `window` tokens only

# What one token holds (independent of how long it is kept, which the kind says):
KV = "kv"  # a key and a value per KV head
LATENT = "latent"  # MLA (DeepSeek): one compressed latent and one shared rotary key
VECTOR = "vector"  # one vector of head_dim floats (DeepSeek-V4: K = V, compressed entries, ...)


class LayerKVLayout(msgspec.Struct, frozen=True):
    kind: str
    num_kv_heads: int
    head_dim: int  # LATENT: the latent's width (kv_lora_rank)
    window: int | None = None  # SLIDING: how many tokens back a query sees (itself included)
    entry: str = KV
    rope_dim: int = 0  # LATENT: the shared rotary key's width
    layer: int = -1  # the decoder layer this entry belongs to (-1: the entry's own index)
    name: str = ""  # which of its layer's entries (DeepSeek-V4: "window", "compressed", ...)

    def entry_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """The shape one token occupies in each of the layer's two cache tensors: K and V,
        (LATENT) the rotary key and the latent, or (VECTOR) one vector and nothing."""
        if self.entry == LATENT:
            return (1, self.rope_dim), (1, self.head_dim)
        if self.entry == VECTOR:
            return (1, self.head_dim), (1, 0)
        return (self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim)

    def bytes_per_token(self, dtype_bytes: int) -> int:
        return sum(h * d for h, d in self.entry_shapes()) * dtype_bytes


class KVGroup(msgspec.Struct, frozen=True):
    """Layers that share a block pool and a block table per request."""

    kind: str = FULL
    window: int | None = None
    layers: tuple[int, ...] = ()  # cache entries (usually one per decoder layer)
    depth: int = 0  # decoder layers with entries here (what an exact window rebuild spans)


class KVCacheLayout(msgspec.Struct, frozen=True):
    layers: tuple[LayerKVLayout, ...]

    def groups(self) -> tuple[KVGroup, ...]:
        """Block groups in a fixed order: full attention first, then sliding windows."""
        keys = sorted({(s.kind != FULL, s.window or 0, s.kind) for s in self.layers})
        groups = []
        for _, window, kind in keys:
            entries = tuple(i for i, s in enumerate(self.layers)
                            if s.kind == kind and (s.window or 0) == window)
            depth = len({i if self.layers[i].layer < 0 else self.layers[i].layer
                         for i in entries})
            groups.append(KVGroup(kind, window or None, entries, depth))
        return tuple(groups)

    def entry(self, layer: int, name: str) -> int:
        """Index of a decoder layer's named entry."""
        return next(i for i, s in enumerate(self.layers) if s.layer == layer and s.name == name)

    def group_of(self, layer: int) -> int:
        return next(g for g, group in enumerate(self.groups()) if layer in group.layers)

    def layers_of(self, kind: str) -> list[int]:
        return [i for i, s in enumerate(self.layers) if s.kind == kind]

    def bytes_per_token(self, dtype_bytes: int, layers: list[int] | None = None) -> int:
        """K and V bytes of one token over `layers` (default: every layer)."""
        picked = range(len(self.layers)) if layers is None else layers
        return sum(self.layers[i].bytes_per_token(dtype_bytes) for i in picked)
