"""The transfer connector, scheduler half: prefill/decode disaggregation (the worker half is
workers/kv_transfer/).

Prefill side: a request marked `remote_decode` finishes after its first token with its blocks
held instead of freed (they are in the prefix cache as usual), and its last output says where
they are. The next plan tells every worker rank which blocks the transfer holds (a rank serves
a read only of a transfer held now, and only its blocks); each rank serves them to the decode
server's matching rank; when each rank has reported the decode side done with them (or the hold
times out, or the request's own client aborts it) they are freed, and the next plan tells the
ranks to refuse late reads.

Decode side: a request with `remote_prefill` is admitted with blocks for its prompt (the full
group reuses this server's own prefix cache; a sliding group allocates only the window's) and
waits while every rank pulls the blocks it lacks. When all ranks report, it runs from the first
token on; a failed pull fails it; an abort meanwhile waits for the ranks to stop writing before
its blocks are freed. A request that ends before it is admitted tells the prefill server to
free its hold at once (an abandoning pull) instead of leaving it to the hold timeout.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kvcache.kv_manager import KVManager
from engine.protocol import (
    KV_TRANSFER_BUCKETS,
    KVHold,
    KVPull,
    KVTransferDone,
    KVTransferParams,
    SampledLogprobs,
    pack_ids,
)
from engine.request import Request
from engine.trust import prompt_digest


@dataclass
class _Held:
    req: Request
    deadline: float
    reports: dict[int, KVTransferDone] = field(default_factory=dict)


@dataclass
class _Receiving:
    req: Request
    reports: dict[int, KVTransferDone] = field(default_factory=dict)
    aborted: bool = False


@dataclass
class TransferCounters:
    blocks: int = 0
    bytes: int = 0
    count: int = 0
    seconds: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(KV_TRANSFER_BUCKETS) + 1))

    def record(self, reports: dict[int, KVTransferDone]) -> None:
        """One finished transfer, as every rank reported it (bytes add up over ranks)."""
        first = reports[min(reports)]
        self.blocks += first.blocks
        self.bytes += sum(r.bytes for r in reports.values())
        seconds = max(r.seconds for r in reports.values())
        self.count += 1
        self.seconds += seconds
        self.buckets[bisect.bisect_left(KV_TRANSFER_BUCKETS, seconds)] += 1


class KVTransfer:
    def __init__(self, kv: KVManager, ranks: int, hold_timeout: float,
                 clock: Callable[[], float] = time.monotonic, kv_dtype: str = "float32") -> None:
        self.kv = kv
        self.kv_dtype = kv_dtype
        self.ranks = ranks
        self.hold_timeout = hold_timeout
        self.clock = clock
        self.held: dict[str, _Held] = {}  # prefill side, by transfer id (= request id)
        self.receiving: dict[str, _Receiving] = {}  # decode side, by request id
        self.counters = TransferCounters()
        self._pulls: list[KVPull] = []
        self._cancels: list[str] = []  # requests whose pulls the ranks must stop
        self._released: list[str] = []
        self._holds: list[KVHold] = []  # new holds the ranks must learn of
        self.expired = 0  # holds freed because no decode server came for them

    @property
    def pending(self) -> int:
        return len(self.held) + len(self.receiving)

    def has_plan(self) -> bool:
        """Pulls to start or stop, or holds to announce, wait to be sent (a plan goes out for
        them even with nothing to compute)."""
        return bool(self._pulls or self._cancels or self._holds)

    def take_plan(self) -> tuple[list[KVPull], list[str], list[str], list[KVHold]]:
        """(pulls to start, requests whose pulls stop, transfer ids released, new holds)."""
        out = self._pulls, self._cancels, self._released, self._holds
        self._pulls, self._cancels, self._released, self._holds = [], [], [], []
        return out

    # ------------------------------------------------------------------ prefill side

    def hold(self, req: Request, logprobs: SampledLogprobs | None) -> KVTransferParams:
        """Keep a finished request's blocks for a decode server; returns where they are."""
        self.held[req.request_id] = _Held(req, self.clock() + self.hold_timeout)
        self._holds.append(KVHold(req.request_id, [pack_ids([b for b in t if b >= 0])
                                                   for t in req.tables]))
        return KVTransferParams(
            do_remote_prefill=True, transfer_id=req.request_id,
            block_ids=[list(t) for t in req.tables], num_tokens=req.num_prompt,
            block_size=self.kv.block_size, first_token=req.output_ids[0], first_logprobs=logprobs,
            kv_dtype=self.kv_dtype, prompt_digest=prompt_digest(req.prompt_ids))

    def confirm(self, msg: KVTransferDone) -> None:
        """A rank's report that the decode side is done with a transfer."""
        held = self.held.get(msg.transfer_id)
        if held is None:
            return
        held.reports[msg.rank] = msg
        if len(held.reports) == self.ranks:
            if not msg.cancelled:
                self.counters.record(held.reports)
            self._free_held(msg.transfer_id)

    def drop(self, transfer_id: str) -> bool:
        """The prefill request's own client went away (or a stop string ended it)."""
        if transfer_id not in self.held:
            return False
        self._free_held(transfer_id)
        return True

    def expire(self) -> None:
        now = self.clock()
        for tid in [t for t, h in self.held.items() if h.deadline <= now]:
            self.expired += 1
            self._free_held(tid)

    def next_deadline(self) -> float | None:
        return min((h.deadline for h in self.held.values()), default=None)

    def _free_held(self, transfer_id: str) -> None:
        self.kv.release(self.held.pop(transfer_id).req)
        self._released.append(transfer_id)

    # ------------------------------------------------------------------ decode side

    def admit(self, req: Request) -> bool:
        """Blocks for a request whose prompt KV is on a prefill server, and the pulls that fill
        them; False (nothing held) when they do not fit now."""
        remote = req.params.remote_prefill
        pairs = self.kv.admit_remote(req, remote.block_ids)
        if pairs is None:
            return False
        self.receiving[req.request_id] = _Receiving(req)
        self._pulls.append(KVPull(req.request_id, remote.transfer_id, remote.addresses,
                                  [pack_ids([x for pair in g for x in pair]) for g in pairs]))
        return True

    def abort(self, request_id: str) -> None:
        """Its client went away: the ranks cancel the pull; blocks go once they all report."""
        self.receiving[request_id].aborted = True
        self._cancels.append(request_id)

    def abandon(self, req: Request) -> None:
        """A request that ended before it was admitted: the ranks tell the prefill server to
        free what it holds for it (their reports concern nothing here)."""
        remote = req.params.remote_prefill
        self._pulls.append(KVPull(req.request_id, remote.transfer_id, remote.addresses, [],
                                  abandon=True))

    def received(self, msg: KVTransferDone) -> tuple[Request, str | None, bool] | None:
        """A rank's pull ended; once every rank's has: (request, error, aborted), its blocks
        already freed unless it can run."""
        entry = self.receiving.get(msg.transfer_id)
        if entry is None:
            return None
        entry.reports[msg.rank] = msg
        if len(entry.reports) < self.ranks:
            return None
        del self.receiving[msg.transfer_id]
        errors = [r.error for r in entry.reports.values() if r.error]
        if entry.aborted or errors:
            self.kv.release(entry.req)
        else:
            self.counters.record(entry.reports)
        return entry.req, (errors[0] if errors else None), entry.aborted
