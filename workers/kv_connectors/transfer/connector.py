"""The transfer connector, worker half (prefill/decode disaggregation): before each forward,
hand the plan's transfer work to this rank's transfer threads (sender.py on a prefill server,
puller.py on a decode server)."""

from __future__ import annotations

import zmq

from deepinfer.engine import envs
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.protocol import TransferWork
from deepinfer.workers.kv_cache import KVCache
from deepinfer.workers.kv_connectors.base import WorkerConnector
from deepinfer.workers.kv_connectors.transfer.puller import KVPuller
from deepinfer.workers.kv_connectors.transfer.sender import KVSender
from deepinfer.workers.kv_connectors.transfer.wire import group_tensors


class KVTransferWorker(WorkerConnector):
    name = "transfer"

    def __init__(self, config: EngineConfig, kv_caches: KVCache,
                 zctx: zmq.Context, rank: int, report_to: str) -> None:
        tensors = group_tensors(config.kv_cache_layout(), kv_caches)
        self.sender = self.puller = None
        secret = envs.cluster_secret()  # required with a disaggregation mode (engine/config.py)
        if config.disaggregation_mode == "prefill":
            self.sender = KVSender(zctx, tensors, config.kv_transfer_host, rank, report_to,
                                   secret, config.kv_transfer_backend)
            self.sender.start()
        elif config.disaggregation_mode == "decode":
            self.puller = KVPuller(zctx, tensors, rank, report_to, config.kv_transfer_timeout,
                                   secret, config.kv_transfer_backend)

    def ready_info(self) -> dict[str, str]:
        """Where decode servers pull from (prefill side)."""
        return {"kv_transfer": self.sender.address} if self.sender is not None else {}

    def before_forward(self, entry: TransferWork) -> None:
        if self.sender is not None:
            if entry.held:
                self.sender.hold(entry.held)
            if entry.released:
                self.sender.release(entry.released)
        if self.puller is not None:
            if entry.cancels:
                self.puller.cancel(entry.cancels)
            if entry.pulls:
                self.puller.submit(entry.pulls)
