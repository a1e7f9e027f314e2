"""The transfer connector, scheduler half: prefill/decode disaggregation (the worker half is
workers/kv_connectors/transfer/).

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

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from deepinfer.engine.kvcache.connectors.base import Arrival, KVConnector, TransferCounters
from deepinfer.engine.kvcache.kv_manager import KVManager
from deepinfer.engine.protocol import (
    FinishReason,
    KVHold,
    KVPull,
    KVTransferDone,
    KVTransferParams,
    SampledLogprobs,
    SamplingParams,
    SchedulerStats,
    TransferWork,
    pack_ids,
)
from deepinfer.engine.request import Request, Status
from deepinfer.engine.trust import prompt_digest


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


class KVTransfer(KVConnector):
    name = "transfer"

    def __init__(self, kv: KVManager, ranks: int, hold_timeout: float,
                 clock: Callable[[], float] = time.monotonic, kv_dtype: str = "float32",
                 num_groups: int = 1, vocab_size: int = 2**31 - 1) -> None:
        self.kv = kv
        self.kv_dtype = kv_dtype
        self.ranks = ranks
        self.hold_timeout = hold_timeout
        self.clock = clock
        self.num_groups = num_groups
        self.vocab_size = vocab_size  # token ids a peer may hand over (a remote first token)
        self.held: dict[str, _Held] = {}  # prefill side, by transfer id (= request id)
        self.receiving: dict[str, _Receiving] = {}  # decode side, by request id
        self.counters = TransferCounters()
        self._work = TransferWork()  # for the next plan
        self.expired = 0  # holds freed because no decode server came for them

    @property
    def pending(self) -> int:
        return len(self.held) + len(self.receiving)

    def has_plan(self) -> bool:
        """Pulls to start or stop, or holds to announce or end, wait to be sent (a plan goes
        out for them even with nothing to compute: a new hold must reach the ranks before a
        decode server asks for it, and a released one must be refused at once, not from
        whenever the next request comes)."""
        w = self._work
        return bool(w.pulls or w.cancels or w.held or w.released)

    def plan_entry(self) -> TransferWork | None:
        work, self._work = self._work, TransferWork()
        return work if work.pulls or work.cancels or work.held or work.released else None

    def fill_stats(self, stats: SchedulerStats) -> None:
        c = self.counters
        stats.kv_transfer_blocks, stats.kv_transfer_bytes = c.blocks, c.bytes
        stats.kv_transfer_count, stats.kv_transfer_seconds = c.count, c.seconds
        stats.kv_transfer_buckets = list(c.buckets)
        stats.kv_transfers_pending = self.pending

    def finished(self, req: Request, status: Status, logprobs: SampledLogprobs | None
                 ) -> tuple[bool, KVTransferParams | None]:
        if status == Status.RECEIVING:
            self._abort_pull(req.request_id)  # its blocks go once the ranks stop writing
            return True, None
        if status == Status.WAITING and req.params.remote_prefill is not None \
                and not req.output_ids:
            self._abandon(req)  # its prompt's KV waits on a prefill server
        if req.finish_reason == FinishReason.LENGTH and req.params.remote_decode \
                and req.tables[0]:
            return True, self._hold(req, logprobs)
        return False, None

    def report(self, msg) -> Arrival | None:
        """A rank's report: the decode side is done with held blocks (prefill), or a pull ended
        (decode: once every rank's has, the request runs from its first token, or fails)."""
        if not isinstance(msg, KVTransferDone):  # another connector's report
            return None
        self._confirm(msg)
        return self._received(msg)

    # ------------------------------------------------------------------ prefill side

    def _hold(self, req: Request, logprobs: SampledLogprobs | None) -> KVTransferParams:
        """Keep a finished request's blocks for a decode server; returns where they are."""
        self.held[req.request_id] = _Held(req, self.clock() + self.hold_timeout)
        self._work.held.append(KVHold(req.request_id, [pack_ids([b for b in t if b >= 0])
                                                       for t in req.tables]))
        return KVTransferParams(
            do_remote_prefill=True, transfer_id=req.request_id,
            block_ids=[list(t) for t in req.tables], num_tokens=req.num_prompt,
            block_size=self.kv.block_size, first_token=req.output_ids[0], first_logprobs=logprobs,
            kv_dtype=self.kv_dtype, prompt_digest=prompt_digest(req.prompt_ids),
            cache_salt=req.cache_salt)

    def _confirm(self, msg: KVTransferDone) -> None:
        """A rank's report that the decode side is done with a transfer."""
        held = self.held.get(msg.transfer_id)
        if held is None:
            return
        held.reports[msg.rank] = msg
        if len(held.reports) == self.ranks:
            if not msg.cancelled:
                self.counters.record(held.reports)
            self._free_held(msg.transfer_id)

    def abort(self, transfer_id: str) -> bool:
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
        self._work.released.append(transfer_id)

    # ------------------------------------------------------------------ decode side

    def check(self, prompt: np.ndarray, params: SamplingParams, cache_salt: int = 0
              ) -> str | None:
        """Why a prefill server's KV cannot continue this request here (None: it can). Its
        blocks enter this server's prefix cache under this prompt's tokens (and adapter): they
        must be the ones the prefill server computed them for."""
        remote = params.remote_prefill
        if remote is None:
            return None
        why = self._mismatch(remote, prompt, cache_salt)
        return None if why is None else f"kv_transfer_params: {why}"

    def _mismatch(self, remote: KVTransferParams, prompt: np.ndarray,
                  cache_salt: int) -> str | None:
        num_prompt = len(prompt)
        if remote.num_tokens != num_prompt:
            return (f"the prefill server computed {remote.num_tokens} prompt tokens, this "
                    f"server's prompt has {num_prompt} (a different model or tokenizer?)")
        if remote.prompt_digest != prompt_digest(prompt):
            return "the prefill server computed another prompt than this request's"
        if remote.cache_salt != cache_salt:
            return ("the prefill server computed the prompt with another LoRA adapter (or "
                    "its files differ from this server's), or with none")
        if not 0 <= remote.first_token < self.vocab_size:
            return f"first_token {remote.first_token} is outside the vocabulary"
        if remote.block_size != self.kv.block_size:
            return (f"block_size {remote.block_size} differs from this server's "
                    f"{self.kv.block_size}")
        if remote.kv_dtype and remote.kv_dtype != self.kv_dtype:
            return (f"the prefill server's KV cache holds {remote.kv_dtype}, this server's "
                    f"{self.kv_dtype} (--kv-cache-dtype)")
        if len(remote.block_ids) != self.num_groups:
            return f"{len(remote.block_ids)} KV groups, this model has {self.num_groups}"
        end = self.kv.allocators[0].blocks_for(num_prompt)
        window = self.kv.remote_window_start(num_prompt)
        for g, table in enumerate(remote.block_ids):
            start = window if g == self.kv.sliding else 0
            if len(table) < end or any(b < 0 for b in table[start:end]):
                return f"the prefill server no longer holds every block of KV group {g}"
        return None

    def admit(self, req: Request) -> bool | None:
        """Blocks for a request whose prompt KV is on a prefill server, and the pulls that fill
        them; False (nothing held) when they do not fit now."""
        remote = req.params.remote_prefill
        if remote is None or req.output_ids:
            return None
        pairs = self.kv.admit_remote(req, remote.block_ids)
        if pairs is None:
            return False
        self.receiving[req.request_id] = _Receiving(req)
        self._work.pulls.append(KVPull(req.request_id, remote.transfer_id, remote.addresses,
                                       [pack_ids([x for pair in g for x in pair])
                                        for g in pairs]))
        return True

    def _abort_pull(self, request_id: str) -> None:
        """Its client went away: the ranks cancel the pull; blocks go once they all report."""
        self.receiving[request_id].aborted = True
        self._work.cancels.append(request_id)

    def _abandon(self, req: Request) -> None:
        """A request that ended before it was admitted: the ranks tell the prefill server to
        free what it holds for it (their reports concern nothing here)."""
        remote = req.params.remote_prefill
        self._work.pulls.append(KVPull(req.request_id, remote.transfer_id, remote.addresses,
                                       [], abandon=True))

    def _received(self, msg: KVTransferDone) -> Arrival | None:
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
        if entry.aborted:
            return None
        if errors:
            return Arrival(entry.req, [], [], f"KV transfer failed: {errors[0]}")
        remote = entry.req.params.remote_prefill
        return Arrival(entry.req, [remote.first_token],
                       [remote.first_logprobs] if remote.first_logprobs else [])
