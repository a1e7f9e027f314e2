"""KV connectors, scheduler halves (base.py: the seam): the host tier for blocks the prefix cache
evicts, and the prefill/decode transfer. `build_connectors` is the one place that names them: the
scheduler and the KV manager only hold the list."""

from __future__ import annotations

from deepinfer.engine.kvcache.connectors.base import Arrival, KVConnector
from deepinfer.engine.kvcache.connectors.host_tier import HostTier
from deepinfer.engine.kvcache.connectors.transfer import KVTransfer
from deepinfer.engine.kvcache.kv_manager import KVManager

__all__ = ["Arrival", "KVConnector", "build_connectors"]


def build_connectors(kv: KVManager, host_blocks: int, worker_ranks: int, hold_timeout: float,
                     kv_dtype: str, vocab_size: int) -> list[KVConnector]:
    """The connectors a scheduler with these settings runs, in the order they are asked: the
    host tier (when it has blocks and there is a prefix cache to feed it), then the transfer."""
    connectors: list[KVConnector] = []
    if host_blocks and kv.cache is not None:
        connectors.append(HostTier(host_blocks, kv.block_size))
    connectors.append(KVTransfer(kv, worker_ranks, hold_timeout, kv_dtype=kv_dtype,
                                 num_groups=len(kv.groups), vocab_size=vocab_size))
    return connectors
