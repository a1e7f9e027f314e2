"""Random paged-KV cases shared by the decode and prefill attention tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.kernels.triton.device import DEVICE


@dataclass
class PagedCache:
    k: torch.Tensor  # [num_blocks, block_size, KVH, D]
    v: torch.Tensor
    tables: torch.Tensor  # [B, MB]: scattered blocks of a shared pool, -1 where freed


def make_cache(gen: torch.Generator, batch: int, kv_heads: int, dim: int, block_size: int,
               max_keys: int, dtype: torch.dtype) -> PagedCache:
    """Scattered, non-contiguous block tables over one pool with spare blocks."""
    max_blocks = -(-max_keys // block_size)
    num_blocks = batch * max_blocks + 3
    k = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen)[: batch * max_blocks]
    tables = perm.view(batch, max_blocks).to(torch.int32)
    return PagedCache(k.to(DEVICE, dtype), v.to(DEVICE, dtype), tables.to(DEVICE))


def free_below(cache: PagedCache, row: int, lo: int) -> None:
    """Marks the blocks wholly below position `lo` freed (-1), as a sliding layer leaves them."""
    block_size = cache.k.shape[1]
    cache.tables[row, : lo // block_size] = -1
