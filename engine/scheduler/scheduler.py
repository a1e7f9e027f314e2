"""Continuous batching over a paged KV cache, with chunked prefill and preemption by recompute.

Pure logic, no sockets and no torch: `schedule()` picks the next step, `update()` applies the
workers' sampled tokens. Tests drive it directly with a hand-made config.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.kv_spec import FULL, KVGroup
from engine.kvcache.kv_manager import KVManager
from engine.kvcache.transfer import KVTransfer
from engine.protocol import (
    FinishReason,
    KVTransferDone,
    NewRequestInfo,
    SampledLogprobs,
    ScheduledSeq,
    SchedulerStats,
    StepPlan,
    StepResult,
    TokenDelta,
    TokenizedRequest,
    pack_ids,
    unpack_ids,
)
from engine.request import Request, Status
from engine.spec.policy import SpecPolicy
from engine.trust import prompt_digest


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    prefill_chunk_size: int = 512
    context_len: int = 4096
    eos_token_ids: tuple[int, ...] = ()
    kv_groups: tuple[KVGroup, ...] = (KVGroup(FULL),)  # from the model's KV cache spec
    prefix_caching: bool = True
    swa_replay_tokens: int | None = None  # None: the window W
    swa_snapshot_interval: int = 0  # window snapshots every this many prompt tokens (0: none)
    host_blocks: int = 0  # host-memory tier for evicted prefix-cache blocks (0: off)
    num_speculative_tokens: int = 0  # draft slots a decode may get (0: no speculation)
    speculative_disable_by_batch_size: int | None = None
    worker_ranks: int = 1  # every rank reports its KV transfers (disaggregation)
    kv_hold_timeout: float = 120.0  # prefill: a held prompt's KV is freed after this
    kv_dtype: str = "float32"  # what the KV cache stores: a transfer's two ends must agree
    vocab_size: int = 2**31 - 1  # token ids a peer may hand over (a remote first token)


@dataclass
class ScheduledStep:
    plan: StepPlan
    scheduled: list[tuple[Request, ScheduledSeq]] = field(default_factory=list)

    @property
    def speculative(self) -> bool:
        """Some seq may return several tokens: the next step must wait for this one."""
        return any(seq.draft_slots for seq in self.plan.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KVManager(config.num_blocks, config.block_size, list(config.kv_groups),
                            config.prefix_caching, config.swa_replay_tokens,
                            config.host_blocks, config.swa_snapshot_interval)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Requests whose grammar the workers are compiling: scheduled only once it is ready.
        self.compiling: dict[str, Request] = {}
        self._finished_for_workers: list[str] = []
        self._arrivals = 0
        self._step_id = 0
        self.num_preemptions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # No request may outgrow the context or the whole KV cache.
        self.max_len = min(config.context_len, config.num_blocks * config.block_size)
        self.allocator = self.kv.allocators[0]  # the full group's pool (tests, stats)
        self.spec = SpecPolicy(config.num_speculative_tokens,
                               config.speculative_disable_by_batch_size)
        # Prefill/decode disaggregation (engine/kvcache/transfer.py): held and pulled KV.
        self.transfer = KVTransfer(self.kv, config.worker_ranks, config.kv_hold_timeout,
                                   kv_dtype=config.kv_dtype)

    # ------------------------------------------------------------------ requests in / out

    def add(self, msg: TokenizedRequest) -> TokenDelta | None:
        """Queue a request; returns an error delta when it can never run."""
        prompt = unpack_ids(msg.prompt_ids)
        if msg.request_id in self.requests:
            return self._reject(msg.request_id, "duplicate request id")
        if len(prompt) >= self.max_len:
            return self._reject(
                msg.request_id,
                f"the prompt has {len(prompt)} tokens but at most {self.max_len - 1} fit "
                "(context length and KV cache size)",
            )
        remote = msg.params.remote_prefill
        if remote is not None:
            why = self._check_remote(remote, prompt)
            if why is not None:
                return self._reject(msg.request_id, f"kv_transfer_params: {why}")
        req = Request(msg.request_id, prompt, msg.params, self._arrivals, self.max_len,
                      len(self.config.kv_groups))
        self._arrivals += 1
        self.requests[req.request_id] = req
        if msg.params.grammar is not None:
            self.compiling[req.request_id] = req
        else:
            self.waiting.append(req)
        return None

    def grammar_ready(self, request_id: str, error: str | None) -> TokenDelta | None:
        """The workers compiled a request's grammar: queue it, answering with an empty delta
        (the tokenizer releases the request's first output on it), or reject it with `error`.
        None when the request was aborted meanwhile."""
        req = self.compiling.pop(request_id, None)
        if req is None:
            return None
        if error is not None:
            del self.requests[request_id]
            self._finished_for_workers.append(request_id)  # the workers drop the grammar
            return self._reject(request_id, error)
        self.waiting.append(req)
        return TokenDelta(request_id, b"")

    def _check_remote(self, remote, prompt) -> str | None:
        """Why a prefill server's KV cannot continue this request here (None: it can). Its
        blocks enter this server's prefix cache under this prompt's tokens: they must be the
        ones the prefill server computed them for."""
        num_prompt = len(prompt)
        if remote.num_tokens != num_prompt:
            return (f"the prefill server computed {remote.num_tokens} prompt tokens, this "
                    f"server's prompt has {num_prompt} (a different model or tokenizer?)")
        if remote.prompt_digest != prompt_digest(prompt):
            return "the prefill server computed another prompt than this request's"
        if not 0 <= remote.first_token < self.config.vocab_size:
            return f"first_token {remote.first_token} is outside the vocabulary"
        if remote.block_size != self.config.block_size:
            return (f"block_size {remote.block_size} differs from this server's "
                    f"{self.config.block_size}")
        if remote.kv_dtype and remote.kv_dtype != self.config.kv_dtype:
            return (f"the prefill server's KV cache holds {remote.kv_dtype}, this server's "
                    f"{self.config.kv_dtype} (--kv-cache-dtype)")
        if len(remote.block_ids) != len(self.config.kv_groups):
            return (f"{len(remote.block_ids)} KV groups, this model has "
                    f"{len(self.config.kv_groups)}")
        end = self.allocator.blocks_for(num_prompt)
        window = self.kv.remote_window_start(num_prompt)
        for g, table in enumerate(remote.block_ids):
            start = window if g == self.kv.sliding else 0
            if len(table) < end or any(b < 0 for b in table[start:end]):
                return f"the prefill server no longer holds every block of KV group {g}"
        return None

    @staticmethod
    def _reject(request_id: str, why: str) -> TokenDelta:
        return TokenDelta(request_id, b"", finish_reason=FinishReason.ERROR, error=why)

    def abort(self, request_ids: list[str], reason: FinishReason = FinishReason.ABORT) -> None:
        """End requests early: ABORT (client gone: nothing is cached) or STOP (a stop string
        matched in the tokenizer: the request finished normally and seeds the prefix cache)."""
        for rid in request_ids:
            if self.compiling.pop(rid, None) is not None:
                del self.requests[rid]
                self._finished_for_workers.append(rid)
                continue
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, reason)
            else:  # a prefill whose KV waits for a decode server: its client is gone
                self.transfer.drop(rid)

    def _finish(self, req: Request, reason: FinishReason,
                logprobs: SampledLogprobs | None = None) -> TokenDelta | None:
        """End a request. A prefill for a decode server (stopped after its first token, which
        `logprobs` describes) keeps its blocks: returns where they are, for its last delta."""
        held = None
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req.status == Status.WAITING:
            self.waiting.remove(req)
            if req.params.remote_prefill is not None and not req.output_ids:
                self.transfer.abandon(req)  # its prompt's KV waits on a prefill server
        elif req.status == Status.RECEIVING:
            self.transfer.abort(req.request_id)  # its blocks go once the ranks stop writing
        req.status = Status.FINISHED
        req.finish_reason = reason
        if reason != FinishReason.ABORT:
            self.kv.cache_request(req)
        if reason == FinishReason.LENGTH and req.params.remote_decode and req.tables[0]:
            held = self.transfer.hold(req, logprobs)
        elif req.request_id not in self.transfer.receiving:
            self.kv.release(req)
        del self.requests[req.request_id]
        if req.sent_to_workers:
            self._finished_for_workers.append(req.request_id)
        return held

    def kv_transfer_done(self, msg: KVTransferDone) -> TokenDelta | None:
        """A rank's KV-transfer report: the decode side is done with held blocks (prefill), or
        a pull ended (decode: the request runs from its first token, or fails)."""
        self.transfer.confirm(msg)
        done = self.transfer.received(msg)
        if done is None:
            return None
        req, error, aborted = done
        if aborted:
            return None
        if error is not None:
            del self.requests[req.request_id]
            return self._reject(req.request_id, f"KV transfer failed: {error}")
        remote = req.params.remote_prefill
        req.status = Status.RUNNING
        self.running.append(req)
        kept, reason = self._append(req, [remote.first_token])
        delta = TokenDelta(req.request_id, pack_ids(req.output_ids),
                           [remote.first_logprobs] if remote.first_logprobs else [], reason,
                           prompt_tokens=req.num_prompt, cached_tokens=req.cached_tokens or 0)
        if reason is not None:
            self._finish(req, reason)
        return delta

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def wants_speculation(self) -> bool:
        """The next step could speculate if the one in flight were applied first."""
        return self.spec.wants(self.running)

    # ------------------------------------------------------------------ the step

    def _preempt(self, req: Request) -> None:
        """Free a running request's KV and queue it first; it will be recomputed, from the
        prefix cache as far as its blocks are still there."""
        self.running.remove(req)
        self.kv.cache_request(req)
        self.kv.release(req)
        req.num_computed = 0
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _chunk(self, req: Request, budget: int) -> int:
        return min(req.total_tokens - req.num_computed, self.config.prefill_chunk_size, budget)


    def schedule(self) -> ScheduledStep | None:
        self.transfer.expire()  # held KV no decode server came for
        budget = self.config.max_num_batched_tokens
        preemptions_before = self.num_preemptions
        chosen: list[tuple[Request, int, int]] = []  # (request, tokens, draft slots)
        # 1. running requests, oldest first: decodes and unfinished prefill chunks.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.spec_in_flight or (req.num_pending and req.length_exhausted()):
                # Its next position is unknown (a speculating step is in flight), or its
                # in-flight token is its last: nothing to compute now.
                i += 1
                continue
            n = self._chunk(req, budget)
            k = 0
            if n == 1:
                k = self.spec.draft_slots(req, len(self.running), budget - n, self.max_len)
            self.kv.drop_outside_window(req, req.num_computed)
            need = self.kv.needs(req, req.num_computed + n + k)
            while not self.kv.can_allocate(need) and req.status == Status.RUNNING:
                self._preempt(self.running[-1])  # the newest goes first
            if req.status != Status.RUNNING:
                break
            self.kv.allocate(req, need)
            chosen.append((req, n, k))
            budget -= n + k
            i += 1
        # 2. admit waiting requests while tokens, sequence slots and free blocks allow
        #    (not in a step that had to preempt: that would only thrash).
        admit = self.num_preemptions == preemptions_before
        max_seqs = self.config.max_num_seqs
        while admit and self.waiting and budget > 0 and len(self.running) < max_seqs:
            req = self.waiting[0]
            if req.num_pending:
                break  # preempted with a token in flight: recompute once it is known
            if req.params.remote_prefill is not None and not req.output_ids:
                # Its prompt's KV is on a prefill server: pull it, compute nothing now.
                if not self.transfer.admit(req):
                    break
                self.waiting.popleft()
                req.cached_tokens = min(req.hit_tokens, req.num_prompt)
                req.status = Status.RECEIVING
                continue
            self.kv.match_prefix(req)
            n = self._chunk(req, budget)
            need = self.kv.needs(req, req.num_computed + n)
            if not self.kv.can_allocate(need):
                self.kv.unmatch_prefix(req)  # keep nothing pinned while it waits
                break
            self.waiting.popleft()
            if req.cached_tokens is None:
                req.cached_tokens = min(req.hit_tokens, req.num_prompt)
            req.status = Status.RUNNING
            self.kv.allocate(req, need)
            self.running.append(req)
            chosen.append((req, n, 0))
            budget -= n
        if not chosen and not self.transfer.has_plan():
            return None
        return self._build_plan(chosen)

    def _build_plan(self, chosen: list[tuple[Request, int, int]]) -> ScheduledStep:
        self._step_id += 1
        step = ScheduledStep(StepPlan(self._step_id, []))
        for req, n, draft_slots in chosen:
            if not req.sent_to_workers:
                # A decode after a remote prefill already has its first token.
                step.plan.new_requests.append(NewRequestInfo(
                    req.request_id, req.prompt_ids.tobytes(), req.params,
                    pack_ids(req.output_ids[:1]) if req.params.remote_prefill else b""))
                req.sent_to_workers = True
            start = req.num_computed
            if req.num_pending:
                # Overlap: the input is the token the in-flight step is sampling; the worker
                # fills it in (empty token_ids is the placeholder).
                assert n == 1 and start == req.num_tokens
                token_ids = b""
            else:
                token_ids = req.tokens(start, start + n).tobytes()
            sample = start + n == req.total_tokens
            seq = ScheduledSeq(req.request_id, token_ids, start,
                               [pack_ids(t) for t in req.tables], sample,
                               req.full_kv_from, req.window_from, draft_slots)
            if start < req.num_prompt:
                self.kv.cache_prefill(req, start, start + n)  # snapshots it passes
            req.num_computed += n
            req.num_pending += sample
            req.spec_in_flight = draft_slots > 0
            if start < req.num_prompt:
                self.prompt_tokens_total += min(n, req.num_prompt - start)
            step.plan.seqs.append(seq)
            step.scheduled.append((req, seq))
        swap_out, swap_in = self.kv.take_copies()
        if swap_out:
            step.plan.swap_out = pack_ids(swap_out)
        if swap_in:
            step.plan.swap_in = pack_ids(swap_in)
        plan = step.plan
        plan.kv_pulls, cancels, plan.kv_released, plan.kv_held = self.transfer.take_plan()
        step.plan.finished = self._finished_for_workers + cancels
        self._finished_for_workers = []
        return step

    def update(self, step: ScheduledStep, result: StepResult) -> list[TokenDelta]:
        """Apply the new tokens; returns one delta per sampled request."""
        sampled = unpack_ids(result.sampled_ids)
        counts = unpack_ids(result.num_sampled) if result.num_sampled else None
        drafts = unpack_ids(result.num_drafts) if result.num_drafts else None
        deltas: list[TokenDelta] = []
        k = pos = 0
        for req, seq in step.scheduled:
            if not seq.sample:
                continue
            n = int(counts[k]) if counts is not None else 1
            new, logprobs = sampled[pos: pos + n], result.logprobs[pos: pos + n]
            proposed = int(drafts[k]) if drafts is not None else 0
            k, pos = k + 1, pos + n
            req.num_pending -= 1
            if seq.draft_slots:
                req.spec_in_flight = False
                self.spec.record(req, proposed, n - 1)
            if req.status == Status.FINISHED:  # aborted, or finished by its previous token
                continue
            kept, reason = self._append(req, new)
            if seq.draft_slots:
                # The accepted drafts' K/V (positions start+1..) was computed in this step;
                # the rejected slots' blocks go back.
                req.num_computed = seq.start_pos + 1 + min(n - 1, kept)
                self.kv.trim(req, req.num_tokens)
            delta = TokenDelta(
                req.request_id, pack_ids(new[:kept]), [lp for lp in logprobs[:kept] if lp],
                reason, prompt_tokens=req.num_prompt, cached_tokens=req.cached_tokens or 0,
                replayed_tokens=req.replayed_tokens,
            )
            deltas.append(delta)
            if reason is not None:
                delta.kv_transfer = self._finish(req, reason, logprobs[0] if logprobs else None)
        return deltas

    def _append(self, req: Request, new) -> tuple[int, FinishReason | None]:
        """Append new tokens until one finishes the request (stop id, EOS, max_tokens):
        returns how many were kept and the finish reason. Later ones are dropped."""
        for i, token in enumerate(new):
            req.output_ids.append(int(token))
            self.generation_tokens_total += 1
            reason = req.check_finished(self.config.eos_token_ids)
            if reason is not None:
                return i + 1, reason
        return len(new), None

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.compiling),
            kv_blocks_total=self.kv.num_total(),
            # Exact when idle (tests and dashboards wait for it), at most 0.25 s old otherwise.
            kv_blocks_free=self.kv.num_reusable(max_age=0.25 if self.running else 0.0),
            kv_blocks_cached=self.kv.cache.num_cached_blocks if self.kv.cache else 0,
            prefix_cache_queries=self.kv.cache.queries_tokens if self.kv.cache else 0,
            prefix_cache_hits=self.kv.cache.hits_tokens if self.kv.cache else 0,
            prefix_cache_evictions=self.kv.cache.evictions if self.kv.cache else 0,
            replayed_tokens=self.kv.replayed_tokens,
            swa_snapshot_hits=self.kv.snapshot_hits,
            swa_snapshots=self.kv.cache.num_snapshots if self.kv.cache else 0,
            host_blocks_used=self.kv.host.num_used if self.kv.host else 0,
            host_blocks_out=self.kv.host.blocks_out if self.kv.host else 0,
            host_blocks_in=self.kv.host.blocks_in if self.kv.host else 0,
            kv_transfer_blocks=self.transfer.counters.blocks,
            kv_transfer_bytes=self.transfer.counters.bytes,
            kv_transfer_count=self.transfer.counters.count,
            kv_transfer_seconds=self.transfer.counters.seconds,
            kv_transfer_buckets=list(self.transfer.counters.buckets),
            kv_transfers_pending=self.transfer.pending,
            num_preemptions=self.num_preemptions,
            num_steps=self._step_id,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            spec_verify_steps=self.spec.verify_steps,
            spec_draft_tokens=self.spec.draft_tokens,
            spec_accepted_tokens=self.spec.accepted_tokens,
            spec_drafts_by_position=list(self.spec.drafts_by_position),
            spec_accepted_by_position=list(self.spec.accepted_by_position),
        )
