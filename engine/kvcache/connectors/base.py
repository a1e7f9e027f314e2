"""The KV-connector seam, scheduler half (vLLM's shape): somewhere outside the device cache that
holds KV blocks, or that KV blocks come from (host memory, another server's cache).

The scheduler and the KV manager hold a list of connectors and know none by name; every hook
has a do-nothing default, so a connector implements only what it takes part in:
- prefix tiers (the KV manager's hooks): be told of blocks entering the prefix cache
  (`on_stored`) and offered one it is about to evict (`on_evict`); continue a prefix hit with
  consecutive blocks it holds (`match` gives their handles, `plan_load` pairs each with the
  device block allocated for it, `loads_wait` says whether the request must wait for them,
  `cancel_loads` withdraws the loads of a request that could not be admitted after all); the
  same for sliding-window snapshots (`on_snapshot`, `on_snapshot_drop`, `match_snapshot`,
  `plan_snapshot_load`);
- requests whose KV lives outside (the scheduler's hooks): refuse one up front (`check`),
  admit one without computing its prompt (`admit`), take part in its end (`finished`: keep its
  blocks, say where they are), and turn the workers' reports into the request going on or
  failing (`report`);
- every step: the plan's entry for its worker half (`plan_entry`, engine/protocol.py
  KVConnectorMeta), whether a plan must go out for it alone (`has_plan`), timers (`expire`,
  `next_deadline`), and its counters (`fill_stats`; what a connector moves is counted by
  `TransferCounters`, whose buckets make the /metrics histograms).
The worker halves (workers/kv_connectors/) run the entries before the forward. No torch here.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from deepinfer.engine.kvcache.kv_events import KVEventLog
from deepinfer.engine.kvcache.radix_cache import Snapshot
from deepinfer.engine.protocol import (
    KV_TRANSFER_BUCKETS,
    DiskWrites,
    KVConnectorMeta,
    KVTransferDone,
    KVTransferParams,
    SampledLogprobs,
    SamplingParams,
    SchedulerStats,
)
from deepinfer.engine.request import Request, Status


@dataclass
class Arrival:
    """A request's KV from outside is in place: it runs on from these output tokens (and their
    logprobs); or it cannot be had (`error`), its blocks already freed. A request that waited
    for loads (LOADING) computes on from where its hit ended (`resume`), or, its loads failed
    and its blocks freed, is looked up again from the start (`retry`)."""

    req: Request
    tokens: list[int] = field(default_factory=list)
    logprobs: list[SampledLogprobs] = field(default_factory=list)
    error: str | None = None
    resume: bool = False
    retry: bool = False


@dataclass
class TransferCounters:
    """Blocks a connector moved (the transfer's pulls, the disk tier's reads or its writes):
    their count, bytes and seconds, and the count per bucket of KV_TRANSFER_BUCKETS that makes
    their /metrics histogram (frontend/server/metrics.py)."""

    blocks: int = 0
    bytes: int = 0
    count: int = 0
    seconds: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(KV_TRANSFER_BUCKETS) + 1))

    def record(self, reports: dict[int, KVTransferDone]) -> None:
        """One finished transfer, as every rank reported it (bytes add up over ranks; it took
        as long as the slowest rank)."""
        first = reports[min(reports)]
        self.blocks += first.blocks
        self.bytes += sum(r.bytes for r in reports.values())
        self.observe(max(r.seconds for r in reports.values()))

    def observe(self, seconds: float) -> None:
        """One transfer that took `seconds` (its blocks and bytes are the caller's to add)."""
        self.count += 1
        self.seconds += seconds
        self.buckets[bisect.bisect_left(KV_TRANSFER_BUCKETS, seconds)] += 1


class KVConnector:
    name = ""  # its key in StepPlan.connectors

    # ------------------------------------------------------------------ prefix tiers

    def on_evict(self, tokens, device_block: int) -> None:
        """`tokens` (every token through the block) are about to lose `device_block`."""

    def on_stored(self, parent_block: int | None, tokens, blocks: list[int]) -> None:
        """`blocks` (holding `tokens`) entered the prefix cache after cached `parent_block`;
        they are computed by the end of the step being planned."""

    def on_snapshot(self, full_block: int, snapshot: Snapshot) -> None:
        """The prefix cache keeps `snapshot` (sliding-window blocks) where its cached block
        `full_block` ends; computed by the end of the step being planned."""

    def on_snapshot_drop(self, snapshot: Snapshot) -> None:
        """The prefix cache lets go of `snapshot`: its blocks may be reused."""

    def report_events(self, log: KVEventLog) -> None:
        """Report the blocks this tier stores and drops to `log` (KV events)."""

    def match(self, tokens, start: int, end: int) -> list[int]:
        """Handles of the blocks that continue a hit at `start`, up to `end` tokens; pinned
        until the plan being built is taken."""
        return []

    def plan_load(self, handle: int, device_block: int) -> None:
        raise NotImplementedError

    def cancel_loads(self, device_blocks: list[int]) -> None:
        """Forget the planned loads into these device blocks."""

    def match_snapshot(self, tokens, hit: int, start: int) -> tuple[int, int] | None:
        """A sliding-window snapshot this tier holds at a block boundary in [start, hit] of
        `tokens` (the deepest): (its position, a handle), pinned like match()'s. `tokens` is
        the array match() got in the same admission (a tier may reuse what it derived)."""
        return None

    def plan_snapshot_load(self, handle: int, sliding_blocks: list[int]) -> None:
        raise NotImplementedError

    def loads_wait(self, req: Request) -> bool:
        """The loads planned since the last call are `req`'s. True: they run off the step loop
        and `req` waits for them (LOADING) until `report` says they landed."""
        return False

    # ------------------------------------------------------------------ requests

    def check(self, prompt: np.ndarray, params: SamplingParams, cache_salt: int = 0
              ) -> str | None:
        """Why a new request can never run here (None: it can, as far as this one knows);
        `cache_salt`: its LoRA adapter's (0: the base model)."""
        return None

    def admit(self, req: Request) -> bool | None:
        """Admit a waiting request whose KV comes from outside: True (its blocks allocated, it
        waits for them: RECEIVING), False (not now: no room), None (not this one's request)."""
        return None

    def finished(self, req: Request, status: Status, logprobs: SampledLogprobs | None
                 ) -> tuple[bool, KVTransferParams | None]:
        """`req` ends (`req.finish_reason`), `status` being what it was. Returns whether this
        connector keeps its blocks (it frees them later itself), and what its last output
        should say about them."""
        return False, None

    def abort(self, request_id: str) -> bool:
        """A client left after its request ended here: drop what this connector keeps for it
        (True when it kept something)."""
        return False

    def report(self, msg: KVTransferDone | DiskWrites) -> Arrival | None:
        """A worker rank's report about this connector's work; an outcome once it is whole
        (None also for a request aborted meanwhile: its blocks are freed, nobody to tell)."""
        return None

    # ------------------------------------------------------------------ every step

    def has_plan(self) -> bool:
        """Work waits for the workers: a plan goes out for it even with nothing to compute."""
        return False

    def plan_entry(self) -> KVConnectorMeta | None:
        """This step's work for the worker half (taken: the next call starts afresh)."""
        return None

    def expire(self) -> None:
        """Let go of what waited too long."""

    def next_deadline(self) -> float | None:
        return None

    @property
    def pending(self) -> int:
        """Transfers held or in flight."""
        return 0

    def fill_stats(self, stats: SchedulerStats) -> None:
        """Set this connector's counters in the scheduler's snapshot."""

