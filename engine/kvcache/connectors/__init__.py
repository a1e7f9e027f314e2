"""KV connectors, scheduler halves (base.py: the seam): the host tier for blocks the prefix cache
evicts, the persistent disk tier, and the prefill/decode transfer. `build_connectors` is the one
place that names them: the scheduler and the KV manager only hold the list."""

from __future__ import annotations

from deepinfer.engine.kvcache.connectors.base import Arrival, KVConnector
from deepinfer.engine.kvcache.connectors.disk_tier import DiskTier, DiskTierSettings
from deepinfer.engine.kvcache.connectors.host_tier import HostTier
from deepinfer.engine.kvcache.connectors.transfer import KVTransfer
from deepinfer.engine.kvcache.kv_manager import KVManager

__all__ = ["Arrival", "DiskTierSettings", "KVConnector", "build_connectors"]


def build_connectors(kv: KVManager, host_blocks: int, worker_ranks: int, hold_timeout: float,
                     kv_dtype: str, vocab_size: int, disk: DiskTierSettings | None = None,
                     block_bytes: int = 0) -> list[KVConnector]:
    """The connectors a scheduler with these settings runs, in the order they are asked: the
    host tier and the disk tier (when there is a prefix cache to feed them), then the
    transfer. `block_bytes`: a full-attention block's bytes over every rank (for /metrics)."""
    connectors: list[KVConnector] = []
    if host_blocks and kv.cache is not None:
        connectors.append(HostTier(host_blocks, kv.block_size, block_bytes))
    if disk is not None and kv.cache is not None:
        connectors.append(DiskTier(kv, disk))
    connectors.append(KVTransfer(kv, worker_ranks, hold_timeout, kv_dtype=kv_dtype,
                                 num_groups=len(kv.groups), vocab_size=vocab_size))
    return connectors
