"""The KV-connector seam, worker half: before each forward, run the copies the scheduler half
(engine/kvcache/connector.py) put in the plan. The host tier's: swap-outs (device -> host)
first, then swap-ins (host -> device), over the full-attention entries, and the same for a
proposer that keeps KV of its own in the target's blocks."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from engine.protocol import StepPlan, unpack_ids
from workers.kv_copy import KVPair, copy_blocks


class HostTierWorker:
    def __init__(self, device: list[KVPair], host: list[KVPair]) -> None:
        self.device, self.host = device, host  # the full-attention entries, pairwise

    def before_forward(self, plan: StepPlan,
                       also: Callable[[torch.Tensor, bool], None] | None = None) -> None:
        """`also(pairs, to_host)`: the same copies for another holder of KV (a proposer)."""
        for packed, to_host in ((plan.swap_out, True), (plan.swap_in, False)):
            if not packed:
                continue
            pairs = torch.from_numpy(unpack_ids(packed).astype(np.int64)).view(-1, 2)
            copy_blocks(pairs, self.device, self.host, to_host)
            if also is not None:
                also(pairs, to_host)
