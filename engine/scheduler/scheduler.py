"""Continuous batching over a paged KV cache, with chunked prefill and preemption by recompute.

Pure logic, no sockets and no torch: `schedule()` picks the next step, `update()` applies the
workers' sampled tokens. Tests drive it directly with a hand-made config.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from deepinfer.engine.kv_identity import request_salt
from deepinfer.engine.kv_layout import FULL, KVGroup
from deepinfer.engine.kvcache.connectors import DiskTierSettings, KVConnector, build_connectors
from deepinfer.engine.kvcache.kv_events import KVEventLog
from deepinfer.engine.kvcache.kv_manager import KVManager
from deepinfer.engine.protocol import (
    DiskWrites,
    FinishReason,
    KVTransferDone,
    KVTransferParams,
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
from deepinfer.engine.request import Request, Status
from deepinfer.engine.scheduler import prompt_logprobs
from deepinfer.engine.scheduler.audit import Auditor
from deepinfer.engine.spec.policy import SpecPolicy


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    prefill_chunk_size: int = 512
    context_len: int = 4096
    eos_token_ids: tuple[int, ...] = ()
    kv_groups: tuple[KVGroup, ...] = (KVGroup(FULL),)  # from the model's KV cache layout
    prefix_caching: bool = True
    swa_replay_tokens: int | None = None  # None: the window W
    swa_snapshot_interval: int = 0  # window snapshots every this many prompt tokens (0: none)
    host_blocks: int = 0  # host-memory tier for evicted prefix-cache blocks (0: off)
    tier_block_bytes: int = 0  # a full-attention block's bytes, all ranks (tier metrics)
    num_speculative_tokens: int = 0  # draft slots a decode may get (0: no speculation)
    speculative_disable_by_batch_size: int | None = None
    worker_ranks: int = 1  # every rank reports its KV transfers (disaggregation)
    kv_hold_timeout: float = 120.0  # prefill: a held prompt's KV is freed after this
    kv_dtype: str = "float32"  # what the KV cache stores: a transfer's two ends must agree
    vocab_size: int = 2**31 - 1  # token ids a peer may hand over (a remote first token)
    # KV events (--kv-events-config): the block identity key (engine/kvcache/block_hash.py);
    # None: no events.
    kv_events_identity: bytes | None = None
    disk_tier: DiskTierSettings | None = None  # --kv-disk-path (None: off)
    # The LoRA adapters the workers serve, each with its salt in the prefix cache's ids.
    lora_salts: dict[str, int] = field(default_factory=dict)
    max_loras: int | None = None  # adapters one batch may use (None: any number)
    # The exactness audit (engine/scheduler/audit.py): the fraction of finished requests re-run
    # cold, whether any difference is a bug (--deterministic), and the shortcuts every request
    # takes on this server (KV dtype, quantization) and a speculating step's (its method).
    audit_rate: float = 0.0
    audit_idle_seconds: float = 0.5  # a re-run starts after the server was idle this long
    deterministic: bool = False
    audit_server_shortcuts: tuple[str, ...] = ()
    spec_shortcut: str = "spec"


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
                            config.swa_snapshot_interval)
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
        # KV held or fetched outside the device cache (engine/kvcache/connectors): the scheduler
        # and the KV manager talk to them only through the seam.
        self.connectors: list[KVConnector] = build_connectors(
            self.kv, config.host_blocks, config.worker_ranks, config.kv_hold_timeout,
            config.kv_dtype, config.vocab_size, config.disk_tier, config.tier_block_bytes)
        self.kv.attach(self.connectors)
        self.audit = Auditor(config.audit_rate, config.deterministic,
                             config.audit_server_shortcuts, idle_seconds=config.audit_idle_seconds)
        self.kv_events: KVEventLog | None = None
        if config.kv_events_identity is not None:
            self.kv_events = KVEventLog(config.kv_events_identity, config.block_size)
            self.kv_events.adapters = {salt: name for name, salt in config.lora_salts.items()}
            self.kv.report_events(self.kv_events)

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
        lora = msg.params.lora
        if lora is not None and lora not in self.config.lora_salts:
            return self._reject(msg.request_id, f"no LoRA adapter {lora!r} is loaded")
        salt = request_salt(self.config.lora_salts[lora] if lora is not None else 0,
                            msg.params.cache_salt)
        for connector in self.connectors:
            why = connector.check(prompt, msg.params, salt)
            if why is not None:
                return self._reject(msg.request_id, why)
        req = Request(msg.request_id, prompt, msg.params, self._arrivals, self.max_len,
                      len(self.config.kv_groups))
        req.cache_salt = salt
        if msg.params.remote_prefill is not None:
            req.shortcuts.add("pd_transfer")
        self.audit.watch(req)
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
            else:  # ended here, but a connector may still keep its KV (for a decode server)
                for connector in self.connectors:
                    connector.abort(rid)

    def _finish(self, req: Request, reason: FinishReason,
                logprobs: SampledLogprobs | None = None) -> KVTransferParams | None:
        """End a request; its blocks are freed unless a connector keeps them (a prefill for a
        decode server, stopped after its first token, which `logprobs` describes; a request
        whose KV is still arriving). Returns what a connector says of them, for its last
        delta."""
        status = req.status
        if status == Status.RUNNING:
            self.running.remove(req)
        elif status == Status.WAITING:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        audit_run = self.audit.is_run(req)  # a cold re-run: it caches and keeps nothing
        if reason != FinishReason.ABORT and status != Status.LOADING and not audit_run:
            self.kv.cache_request(req)
        kept, said = False, None
        for connector in self.connectors if not audit_run else ():
            keeps, params = connector.finished(req, status, logprobs)
            kept, said = kept or keeps, said or params
        self.audit.finished(req, reason)
        if not kept:
            self.kv.release(req)
        del self.requests[req.request_id]
        if req.sent_to_workers:
            self._finished_for_workers.append(req.request_id)
        return said

    def connector_report(self, msg: KVTransferDone | DiskWrites) -> TokenDelta | None:
        """A worker rank's report on a connector's work: a request whose KV arrived from
        outside runs on from the tokens it came with, or fails."""
        for connector in self.connectors:
            outcome = connector.report(msg)
            if outcome is not None:
                break
        else:
            return None
        req = outcome.req
        if outcome.retry:  # its loads failed: look it up again, first in line
            req.status, req.cached_tokens = Status.WAITING, None
            self.waiting.appendleft(req)
            return None
        if outcome.resume:  # its prefix is in place: it computes on from the hit
            req.status = Status.RUNNING
            self.running.append(req)
            return None
        if outcome.error is not None:
            del self.requests[req.request_id]
            return self._reject(req.request_id, outcome.error)
        req.status = Status.RUNNING
        self.running.append(req)
        kept, reason = self._append(req, outcome.tokens)
        delta = TokenDelta(req.request_id, pack_ids(req.output_ids),
                           self.audit.observe(req, outcome.logprobs[:kept]) or [],
                           reason, prompt_tokens=req.num_prompt,
                           cached_tokens=req.cached_tokens or 0)
        if reason is not None:
            self._finish(req, reason)
        return delta

    def has_connector_work(self) -> bool:
        """A connector has work for the workers (a plan goes out for it alone)."""
        return any(c.has_plan() for c in self.connectors)

    def connector_plan(self) -> ScheduledStep | None:
        """A plan of the connectors' work alone (stopping: e.g. the disk tier's last saves)."""
        return self._build_plan([]) if self.has_connector_work() else None

    def connector_deadline(self) -> float | None:
        """When a connector next lets go of something that waited too long, or an audit's
        re-run may start (the loop wakes then to plan it)."""
        deadlines = [d for c in self.connectors if (d := c.next_deadline()) is not None]
        start = self.audit.next_start()
        return min(deadlines + ([start] if start is not None else []), default=None)

    def expire(self) -> None:
        for connector in self.connectors:
            connector.expire()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.audit.has_jobs())

    def wants_speculation(self) -> bool:
        """The next step could speculate if the one in flight were applied first."""
        return self.spec.wants(self.running)

    # ------------------------------------------------------------------ the step

    def _preempt(self, req: Request) -> None:
        """Free a running request's KV and queue it first; it will be recomputed, from the
        prefix cache as far as its blocks are still there."""
        self.running.remove(req)
        if not self.audit.is_run(req):
            self.kv.cache_request(req)
        self.kv.release(req)
        req.num_computed = 0
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _chunk(self, req: Request, budget: int) -> int:
        return min(req.total_tokens - req.num_computed, self.config.prefill_chunk_size, budget)


    def _audit_turn(self) -> None:
        """An audit's cold re-run only while no live request exists: one that came ends it
        (its job waits again); once none was left for a while, the next job starts
        (engine/scheduler/audit.py)."""
        run = self.audit.run[1] if self.audit.run is not None else None
        live = len(self.requests) - (run is not None)
        if run is not None and live:
            self._finish(run, FinishReason.ABORT)
        if not self.audit.idle(not live, time.monotonic()):
            return
        if run is None and self.audit.has_jobs():
            req = self.audit.start(self._arrivals, self.max_len, len(self.config.kv_groups))
            self._arrivals += 1
            self.requests[req.request_id] = req
            self.waiting.append(req)

    def schedule(self) -> ScheduledStep | None:
        self.expire()  # e.g. held KV no decode server came for
        self._audit_turn()
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
        adapters = self._running_adapters()
        passed_over: list[Request] = []  # of an adapter the batch has no room for: wait
        while admit and self.waiting and budget > 0 and len(self.running) < max_seqs:
            req = self.waiting[0]
            if req.num_pending:
                break  # preempted with a token in flight: recompute once it is known
            lora = req.params.lora
            if adapters is not None and lora is not None and lora not in adapters:
                if len(adapters) >= self.config.max_loras:
                    passed_over.append(self.waiting.popleft())
                    continue
                adapters.add(lora)
            outside = None if self.audit.is_run(req) else self._admit_from_connector(req)
            if outside is False:
                break
            if outside:  # its KV comes from outside: compute nothing now
                self.waiting.popleft()
                req.cached_tokens = min(req.hit_tokens, req.num_prompt)
                req.status = Status.RECEIVING
                req.shortcuts.add("pd_transfer")
                continue
            # Prompt logprobs need every prompt position's logits: no cached prefix.
            cold = prompt_logprobs.wants(req) or self.audit.is_run(req)
            if self.kv.match_prefix(req, reuse=not cold):
                # Its prefix is read off the step loop; others run meanwhile (connector_report).
                self.waiting.popleft()
                if req.cached_tokens is None:
                    req.cached_tokens = min(req.hit_tokens, req.num_prompt)
                req.status = Status.LOADING
                continue
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
        self.waiting.extendleft(reversed(passed_over))  # in their order, first in line
        if not chosen and not self.has_connector_work():
            return None
        return self._build_plan(chosen)

    def _running_adapters(self) -> set[str] | None:
        """The LoRA adapters the running requests use, and those whose KV is being loaded or
        received (they join the batch when it lands); None: no --max-loras to keep."""
        if self.config.max_loras is None:
            return None
        joining = (Status.RUNNING, Status.LOADING, Status.RECEIVING)
        return {r.params.lora for r in self.requests.values()
                if r.params.lora is not None and r.status in joining}

    def _fail_lora_rows(self, step: ScheduledStep, errors: dict[str, str]) -> list[TokenDelta]:
        """The step's requests of an adapter the workers could not read back (its rows ran
        without it): each fails alone, caching nothing of what it computed."""
        failed = []
        for req, _ in step.scheduled:
            why = errors.get(req.params.lora) if req.params.lora is not None else None
            if why is not None and req.status != Status.FINISHED:
                self._finish(req, FinishReason.ABORT)
                failed.append(self._reject(req.request_id, "the LoRA adapter "
                                           f"{req.params.lora!r} cannot be served: {why}"))
        return failed

    def _admit_from_connector(self, req: Request) -> bool | None:
        """A connector's admission of a request whose KV comes from outside (see
        KVConnector.admit); None when none takes it."""
        for connector in self.connectors:
            admitted = connector.admit(req)
            if admitted is not None:
                return admitted
        return None

    def _build_plan(self, chosen: list[tuple[Request, int, int]]) -> ScheduledStep:
        self._step_id += 1
        step = ScheduledStep(StepPlan(self._step_id, []))
        for req, n, draft_slots in chosen:
            if len(chosen) > 1:
                req.shortcuts.add("batch")
            if draft_slots:
                req.shortcuts.add(self.config.spec_shortcut)
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
                               req.full_kv_from, req.window_from, draft_slots,
                               prompt_logprobs.chunk_asks(req, start, n))
            if start < req.num_prompt and not self.audit.is_run(req):
                self.kv.cache_prefill(req, start, start + n)  # snapshots it passes
            req.num_computed += n
            req.num_pending += sample
            req.spec_in_flight = draft_slots > 0
            if start < req.num_prompt:
                self.prompt_tokens_total += min(n, req.num_prompt - start)
            step.plan.seqs.append(seq)
            step.scheduled.append((req, seq))
        for connector in self.connectors:
            entry = connector.plan_entry()
            if entry is not None:
                step.plan.connectors[connector.name] = entry
        step.plan.finished = self._finished_for_workers
        self._finished_for_workers = []
        return step

    def update(self, step: ScheduledStep, result: StepResult) -> list[TokenDelta]:
        """Apply the new tokens; returns one delta per sampled request."""
        sampled = unpack_ids(result.sampled_ids)
        counts = unpack_ids(result.num_sampled) if result.num_sampled else None
        drafts = unpack_ids(result.num_drafts) if result.num_drafts else None
        deltas = self._fail_lora_rows(step, result.lora_errors) if result.lora_errors else []
        k = pos = 0
        prompt_pieces = iter(result.prompt_logprobs)
        for req, seq in step.scheduled:
            if seq.prompt_logprobs:
                piece = next(prompt_pieces, None)
                if piece is not None and req.status != Status.FINISHED:
                    prompt_logprobs.receive(req, piece)
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
            sent = self.audit.observe(req, logprobs[:kept])
            if sent is None:  # an audit's cold re-run: nothing goes to a client
                if reason is not None:
                    self._finish(req, reason)
                continue
            delta = TokenDelta(
                req.request_id, pack_ids(new[:kept]), sent,
                reason, prompt_tokens=req.num_prompt, cached_tokens=req.cached_tokens or 0,
                replayed_tokens=req.replayed_tokens,
                prompt_logprobs=prompt_logprobs.take(req),
            )
            deltas.append(delta)
            if reason is not None:
                delta.kv_transfer = self._finish(req, reason, logprobs[0] if logprobs else None)
        return deltas

    def _append(self, req: Request, new) -> tuple[int, FinishReason | None]:
        """Append new tokens until one finishes the request (stop id, EOS, max_tokens):
        returns how many were kept and the finish reason. Later ones are dropped."""
        if req.params.max_tokens == 0:  # prompt scoring (echo): the drawn token is no output
            return 0, FinishReason.LENGTH
        for i, token in enumerate(new):
            req.output_ids.append(int(token))
            self.generation_tokens_total += 1
            reason = req.check_finished(self.config.eos_token_ids)
            if reason is not None:
                return i + 1, reason
        return len(new), None

    def stats(self) -> SchedulerStats:
        stats = SchedulerStats(
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
        for connector in self.connectors:
            connector.fill_stats(stats)
        self.audit.fill_stats(stats)
        return stats
