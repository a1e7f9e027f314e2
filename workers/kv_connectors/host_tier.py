"""The host tier, worker half: before each forward, run the copies the scheduler half
(engine/kvcache/connectors/host_tier.py) put in the plan: saves (device -> host) with every
connector's saves, then loads (host -> device), over the full-attention entries of every
holder of KV in the target's blocks: the target's cache and a proposer's own
(workers/kv_cache.py). It keeps one host pool per device pair."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from deepinfer.engine.protocol import HostTierCopies, unpack_ids
from deepinfer.workers.kv_cache import KVCache, KVPair
from deepinfer.workers.kv_connectors.base import WorkerConnector


def copy_blocks(pairs: torch.Tensor, device: Sequence[KVPair], host: Sequence[KVPair],
                save: bool) -> None:
    """pairs [n, 2] int64: (device block, host block) when `save`, else (host, device). The
    scheduler never repeats a target block within one plan: an indexed copy with repeated
    targets keeps either source."""
    for dev_kv, host_kv in zip(device, host):
        for dev, hst in zip(dev_kv, host_kv):
            src, dst = (dev, hst) if save else (hst, dev)
            # Each index where its tensor is; the gathered blocks cross once (a GPU cache and
            # its host tier), blocking, since the next statement reads them.
            rows = src.index_select(0, pairs[:, 0].to(src.device))
            dst.index_copy_(0, pairs[:, 1].to(dst.device), rows.to(dst.device))


def host_pairs(device: Sequence[KVPair], blocks: int) -> list[KVPair]:
    """A host pool of `blocks` blocks shaped like each device pair, pinned beside a GPU
    (page-locked memory is what the GPU copies to and from directly)."""
    def like(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros((blocks, *t.shape[1:]), dtype=t.dtype, device="cpu",
                           pin_memory=t.is_cuda)
    return [(like(k), like(v)) for k, v in device]


class HostTierWorker(WorkerConnector):
    name = "host_tier"

    def __init__(self, holders: Sequence[KVCache], host_blocks: int) -> None:
        """`holders`: the target's cache first, then any proposer's."""
        self.device = [pair for cache in holders for pair in cache.full_attention()]
        self.host = host_pairs(self.device, host_blocks)

    def save(self, entry: HostTierCopies) -> None:
        self._copy(entry.saves, True)

    def before_forward(self, entry: HostTierCopies) -> None:
        self._copy(entry.loads, False)

    def _copy(self, packed: bytes, save: bool) -> None:
        if packed:
            pairs = torch.from_numpy(unpack_ids(packed).astype(np.int64)).view(-1, 2)
            copy_blocks(pairs, self.device, self.host, save)
