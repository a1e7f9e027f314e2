"""The worker side's tensor helpers for a KV transfer; the messages themselves (torch-free, the
PD router sends one) are in engine/kv_transfer_wire.py."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.engine.kv_layout import KVCacheLayout


def group_tensors(layout: KVCacheLayout,
                  kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]
                  ) -> list[list[torch.Tensor]]:
    """Per KV group, the cache tensors a block spans (empty ones left out), in a fixed order
    both sides derive from the same layout."""
    return [[t for i in g.layers for t in kv_caches[i] if t.numel()] for g in layout.groups()]


def as_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU copy's raw bytes (any dtype, bfloat16 included; none for no blocks)."""
    return memoryview(t.contiguous().cpu().view(torch.uint8).numpy().reshape(-1))
