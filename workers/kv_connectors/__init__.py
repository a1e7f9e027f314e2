"""KV connectors, worker halves (base.py: the seam): the host tier's block copies and the
prefill/decode transfer threads. `build_worker_connectors` is the one place that names them: the
runner only holds the list."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.engine.config import FULL, EngineConfig
from deepinfer.workers.kv_connectors.base import WorkerConnector
from deepinfer.workers.kv_connectors.host_tier import Copier, HostTierWorker

__all__ = ["WorkerConnector", "build_worker_connectors"]


def build_worker_connectors(config: EngineConfig,
                            kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                            others: Sequence[Copier] = (), transport=None
                            ) -> list[WorkerConnector]:
    """This rank's connectors, the halves of the scheduler's (engine/kvcache/connectors).
    `others`: the host-tier copies of other holders of KV in the same blocks (a proposer);
    `transport`: (zmq context, rank, where reports go) for the transfer, on a worker process."""
    connectors: list[WorkerConnector] = []
    host_blocks = config.host_kv_blocks()
    if host_blocks:
        full = [kv_caches[i] for i in config.kv_cache_layout().layers_of(FULL)]
        connectors.append(HostTierWorker(full, host_blocks, others))
    if config.disaggregation_mode != "none" and transport is not None:
        from deepinfer.workers.kv_connectors.transfer.connector import KVTransferWorker

        connectors.append(KVTransferWorker(config, kv_caches, *transport))
    return connectors
