"""The transfer connector, worker half (prefill/decode disaggregation): before each forward,
hand the plan's KV-transfer work to this rank's transfer thread (workers/kv_transfer/sender.py
on a prefill server, puller.py on a decode server)."""

from __future__ import annotations

import torch
import zmq

from engine import envs
from engine.config import EngineConfig
from engine.protocol import StepPlan
from workers.kv_transfer.puller import KVPuller
from workers.kv_transfer.sender import KVSender
from workers.kv_transfer.wire import group_tensors


class KVTransferWorker:
    def __init__(self, config: EngineConfig, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 zctx: zmq.Context, rank: int, report_to: str) -> None:
        tensors = group_tensors(config.kv_cache_spec(), kv_caches)
        self.sender = self.puller = None
        secret = envs.cluster_secret()  # required with a disaggregation mode (engine/config.py)
        if config.disaggregation_mode == "prefill":
            self.sender = KVSender(zctx, tensors, config.kv_transfer_host, rank, report_to,
                                   secret, config.kv_transfer_backend)
            self.sender.start()
        elif config.disaggregation_mode == "decode":
            self.puller = KVPuller(zctx, tensors, rank, report_to, config.kv_transfer_timeout,
                                   secret, config.kv_transfer_backend)

    @property
    def address(self) -> str | None:
        """Where decode servers pull from (prefill side)."""
        return self.sender.address if self.sender is not None else None

    def before_forward(self, plan: StepPlan) -> None:
        if self.sender is not None:
            if plan.kv_held:
                self.sender.hold(plan.kv_held)
            if plan.kv_released:
                self.sender.release(plan.kv_released)
        if self.puller is not None:
            if plan.finished:
                self.puller.cancel(plan.finished)
            if plan.kv_pulls:
                self.puller.submit(plan.kv_pulls)
