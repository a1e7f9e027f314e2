"""KV connectors, worker halves (base.py: the seam): the host tier's block copies, the disk
tier's writer and loader threads and the prefill/decode transfer threads.
`build_worker_connectors` is the one place that names them: the runner only holds the list."""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer.engine.config import EngineConfig
from deepinfer.workers.kv_cache import KVCache
from deepinfer.workers.kv_connectors.base import WorkerConnector
from deepinfer.workers.kv_connectors.host_tier import HostTierWorker

__all__ = ["WorkerConnector", "build_worker_connectors"]


def build_worker_connectors(config: EngineConfig, kv_caches: KVCache,
                            others: Sequence[KVCache] = (), transport=None
                            ) -> list[WorkerConnector]:
    """This rank's connectors, the halves of the scheduler's (engine/kvcache/connectors).
    `others`: other holders of KV in the same blocks (a proposer's cache), which the host and
    disk tiers copy beside the target's; `transport`: (zmq context, rank, where reports go) for the
    transfer, on a worker process."""
    connectors: list[WorkerConnector] = []
    host_blocks = config.host_kv_blocks()
    if host_blocks:
        connectors.append(HostTierWorker([kv_caches, *others], host_blocks))
    if config.disk_kv_blocks() and transport is not None:
        from deepinfer.engine.kv_identity import kv_block_identity
        from deepinfer.workers.kv_connectors.disk_tier import DiskTierWorker

        zctx, rank, report_to = transport
        connectors.append(DiskTierWorker([kv_caches, *others], config.kv_disk_path,
                                         kv_block_identity(config), rank, zctx, report_to))
    if config.disaggregation_mode != "none" and transport is not None:
        from deepinfer.workers.kv_connectors.transfer.connector import KVTransferWorker

        connectors.append(KVTransferWorker(config, kv_caches, *transport))
    return connectors
