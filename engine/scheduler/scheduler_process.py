"""The scheduler actor: requests in from the tokenizer, step plans out to the workers.

With overlap scheduling (the default) the loop sends plan N+1 before it reads result N, so
the workers always have the next step queued while the scheduler applies the previous one;
step N+1 refers to tokens sampled in step N by placeholder (see ScheduledSeq). A step that
speculates returns an unknown number of tokens per request, so the loop applies it before
planning the next one (engine/spec/policy.py says when a request speculates).
"""

from __future__ import annotations

import logging
import signal
import time

import msgspec
import zmq

from deepinfer.engine import envs
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.kv_disk_files import block_payloads
from deepinfer.engine.kv_identity import adapter_salt_at, kv_block_identity
from deepinfer.engine.kvcache.connectors import DiskTierSettings
from deepinfer.engine.kvcache.event_publisher import ZmqEventPublisher
from deepinfer.engine.model_config import FULL
from deepinfer.engine.protocol import (
    Abort,
    CompileGrammar,
    DiskWrites,
    GrammarReady,
    KVTransferDone,
    LoRAUpdate,
    LoRAUpdated,
    SchedulerInbound,
    Shutdown,
    StepResult,
    TokenBatch,
    TokenizedRequest,
)
from deepinfer.engine.runtime.ipc import plan_sender, pull, push
from deepinfer.engine.runtime.process_entry import ChildContext
from deepinfer.engine.scheduler.lora_updates import RuntimeAdapters
from deepinfer.engine.scheduler.scheduler import ScheduledStep, Scheduler, SchedulerConfig
from deepinfer.engine.statistics import progress_line

log = logging.getLogger("deepinfer.scheduler")



def build_scheduler(ctx: ChildContext) -> Scheduler:
    cfg = ctx.config
    model = cfg.model_config()
    return Scheduler(SchedulerConfig(
        num_blocks=cfg.kv_blocks(),
        block_size=cfg.block_size,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        prefill_chunk_size=cfg.prefill_chunk_size,
        context_len=cfg.context_len(),
        eos_token_ids=model.eos_token_ids,
        kv_groups=model.kv_cache_layout().groups(),
        prefix_caching=cfg.enable_prefix_caching,
        swa_replay_tokens=cfg.swa_replay_tokens(),
        swa_snapshot_interval=cfg.swa_snapshot_tokens(),
        host_blocks=cfg.host_kv_blocks(),
        tier_block_bytes=full_block_bytes(cfg),
        num_speculative_tokens=cfg.num_speculative_tokens if cfg.speculative_method else 0,
        speculative_disable_by_batch_size=cfg.speculative_disable_by_batch_size,
        worker_ranks=cfg.tensor_parallel_size,
        kv_hold_timeout=cfg.kv_hold_timeout,
        kv_dtype=cfg.kv_dtype(),
        vocab_size=model.vocab_size,
        kv_events_identity=kv_block_identity(cfg) if cfg.kv_events() is not None else None,
        disk_tier=disk_tier_settings(cfg),
        lora_salts={name: adapter_salt_at(name, path)
                    for name, path in cfg.lora_adapters().items()},
        max_loras=cfg.max_loras if cfg.enable_lora else None,
        audit_rate=cfg.audit_rate,
        deterministic=cfg.deterministic,
        audit_server_shortcuts=server_shortcuts(cfg),
        spec_shortcut=f"spec_{cfg.speculative_method}",
    ))


def server_shortcuts(cfg: EngineConfig) -> tuple[str, ...]:
    """What every request on this server takes that a float32 run would not (the audit's
    labels): a half-precision KV cache, quantized weights."""
    out = []
    if cfg.dtype != "float32":
        out.append(f"dtype_{cfg.dtype}")
    if cfg.kv_dtype() != "float32":
        out.append(f"kv_{cfg.kv_dtype()}")
    quantization = cfg.quantization or cfg.model_config().quantization
    if quantization not in (None, "none"):
        out.append(f"quant_{quantization}")
    return tuple(out)


def full_block_bytes(cfg: EngineConfig) -> int:
    """A block's bytes over the full-attention layers: what the host and disk tiers keep."""
    full = cfg.kv_cache_layout().layers_of(FULL)
    return cfg.kv_bytes_per_block(full) if full else 0


def disk_tier_settings(cfg: EngineConfig) -> DiskTierSettings | None:
    if not cfg.disk_kv_blocks():
        return None
    full, window = block_payloads(cfg)
    return DiskTierSettings(cfg.kv_disk_path, kv_block_identity(cfg),
                            int(cfg.kv_disk_gb * (1 << 30)), full, cfg.tensor_parallel_size,
                            window)


class SchedulerLoop:
    def __init__(self, ctx: ChildContext) -> None:
        self.scheduler = build_scheduler(ctx)
        self.overlap = ctx.config.overlap_scheduling
        self.zmq = ctx.zmq
        self.inbound = pull(ctx.zmq, ctx.endpoints.scheduler_in)
        self.to_tokenizer = push(ctx.zmq, ctx.endpoints.tokenizer_in)
        self.to_workers = [plan_sender(ctx.zmq, addr, envs.cluster_secret())
                           for addr in ctx.endpoints.workers_in]
        self.decode = msgspec.msgpack.Decoder(SchedulerInbound).decode
        self.encode = msgspec.msgpack.Encoder().encode
        self.pending: list = []  # requests/aborts that arrived while we waited for a result
        self.results: dict[int, StepResult] = {}
        self.stats = self.scheduler.stats()
        self._logged = (time.monotonic(), self.stats)
        # KV events (--kv-events-config): batches of what entered and left the caches.
        events = ctx.config.kv_events()
        self.dp_rank = ctx.config.data_parallel_rank
        self.publisher = ZmqEventPublisher(events) if events is not None else None
        self.planning = self.stop_requested = self.stopping = False  # (SIGTERM: see stop)
        events = self.scheduler.kv_events
        self.adapters = RuntimeAdapters(self.scheduler.config.lora_salts,
                                        events.adapters if events is not None else None)
        self._publish_events()  # AllBlocksCleared: routers forget what a restart lost

    def run(self) -> None:
        in_flight: ScheduledStep | None = None
        while True:
            self._unload_unused_adapters()
            # Idle: nothing in flight, to run, or to tell the ranks (a new hold of a prompt's
            # KV must reach them before a decode server asks for it).
            idle = (in_flight is None and not self.scheduler.has_work()
                    and not self.scheduler.has_connector_work())
            self._handle(self._drain(block=idle and not self.pending))
            if in_flight is not None and (in_flight.speculative
                                          or self.scheduler.wants_speculation()):
                # A speculating step's new tokens (and so the next positions) are unknown
                # until its result is applied: no overlap across it (engine/spec/policy.py).
                self._finish_step(in_flight)
                in_flight = None
            t0 = time.perf_counter()
            # A SIGTERM meanwhile waits until the plan is out: what its connector entries took
            # (the disk tier's saves) must reach the ranks.
            self.planning = True
            step = self.scheduler.schedule()
            self.stats.schedule_seconds += time.perf_counter() - t0
            if step is not None:
                self._send_workers(step.plan)
            self.planning = False
            if self.stop_requested:
                self.stop()
            if in_flight is None and step is None and self.scheduler.has_work():
                # Nothing fits and nothing runs: only a new message (or a held prompt's KV
                # timing out) can change that.
                self.pending.extend(self._wait_message())
            if in_flight is not None:
                self._finish_step(in_flight)
            if step is not None and not self.overlap:
                self._finish_step(step)
                step = None
            in_flight = step
            self._publish_events()

    def stop(self) -> None:
        """SIGTERM: the connectors' last work, then every rank told to exit (ranks on other
        hosts are not the launcher's to stop), then the last KV events; exits. A second
        SIGTERM while this runs (the launcher may signal twice) changes nothing."""
        if self.stopping:
            return
        self.stopping = True
        last = self.scheduler.connector_plan()  # e.g. blocks the disk tier has yet to save
        if last is not None:
            self._send_workers(last.plan)
        self._send_workers(Shutdown())
        if self.publisher is not None:  # what the last steps changed still reaches routers
            self._publish_events()
            self.publisher.close(timeout=0.5)
        # Deliver before leaving: at interpreter exit pyzmq drops what is still queued, and a
        # rank that never gets its Shutdown waits out its grace period (1.5 s) instead.
        for sock in self.to_workers:
            sock.close(linger=1000)
        self.zmq.destroy(linger=0)  # the other sockets: nothing of theirs is worth waiting for
        raise SystemExit(0)

    def _publish_events(self) -> None:
        """Hand this iteration's KV events to the publisher's thread (nothing to send: no-op)."""
        if self.publisher is not None:
            batch = self.scheduler.kv_events.batch(self.dp_rank)
            if batch is not None:
                self.publisher.publish(batch)

    def _drain(self, block: bool) -> list:
        msgs, self.pending = self.pending, []
        if block:
            msgs.extend(self._wait_message())  # idle: block, never spin
        while self.inbound.poll(0):
            msgs.append(self.decode(self.inbound.recv(zmq.NOBLOCK)))
        return msgs

    def _wait_message(self) -> list:
        """The next message; none when a held prompt's KV times out first (prefill side)."""
        self._publish_events()  # before sleeping: nothing waits behind an idle loop
        deadline = self.scheduler.connector_deadline()
        if deadline is not None:
            timeout_ms = max(0, int((deadline - time.monotonic()) * 1000)) + 1
            if not self.inbound.poll(timeout_ms):
                self.scheduler.expire()
                self.to_tokenizer.send(self.encode(TokenBatch([], self._stats())))
                return []
        return [self.decode(self.inbound.recv())]

    def _handle(self, msgs: list) -> None:
        if not msgs:
            return
        deltas, lora_answers = [], []
        for msg in msgs:
            if isinstance(msg, TokenizedRequest):
                err = self.scheduler.add(msg)
                if err is not None:
                    deltas.append(err)
                elif msg.params.grammar is not None:
                    self._send_workers(CompileGrammar(msg.request_id, msg.params.grammar))
            elif isinstance(msg, GrammarReady):
                delta = self.scheduler.grammar_ready(msg.request_id, msg.error)
                if delta is not None:
                    deltas.append(delta)
            elif isinstance(msg, Abort):
                self.scheduler.abort(msg.request_ids, msg.reason)
            elif isinstance(msg, StepResult):
                self.results[msg.step_id] = msg
            elif isinstance(msg, (KVTransferDone, DiskWrites)):
                delta = self.scheduler.connector_report(msg)
                if delta is not None:
                    deltas.append(delta)
            elif isinstance(msg, LoRAUpdate):
                to_workers, answer = self.adapters.update(msg)
                if to_workers is not None:
                    self._send_workers(to_workers)
                lora_answers.append(answer)
            elif isinstance(msg, LoRAUpdated):
                lora_answers.append(self.adapters.loaded(msg))
        # Always report: rejections, and freed blocks after aborts, show up right away.
        self.to_tokenizer.send(self.encode(TokenBatch(
            deltas, self._stats(), [a for a in lora_answers if a is not None])))

    def _unload_unused_adapters(self) -> None:
        """Send the workers each waiting unload whose adapter no request uses any more, and
        answer its client."""
        if not self.adapters.unloading:
            return
        due = self.adapters.unloads_due(r.params.lora for r in self.scheduler.requests.values())
        for msg in due:
            self._send_workers(msg)
        if due:
            self.to_tokenizer.send(self.encode(TokenBatch(
                [], self._stats(), [LoRAUpdated(m.request_id) for m in due])))

    def _send_workers(self, msg) -> None:
        payload = self.encode(msg)
        for sock in self.to_workers:
            sock.send(payload)

    def _finish_step(self, step: ScheduledStep) -> None:
        t0 = time.perf_counter()
        result = self._await_result(step.plan.step_id)
        t1 = time.perf_counter()
        deltas = self.scheduler.update(step, result)
        self._log_divergences()
        s = self.stats
        s.wait_seconds += t1 - t0
        s.update_seconds += time.perf_counter() - t1
        s.forward_seconds += result.forward_ms / 1e3
        s.sample_seconds += result.sample_ms / 1e3
        self.to_tokenizer.send(self.encode(TokenBatch(deltas, self._stats())))
        self._log_progress()

    def _log_divergences(self) -> None:
        """Each cold re-run that differed (--audit-rate); with --deterministic a bug."""
        for found in self.scheduler.audit.take_found():
            level = logging.ERROR if self.scheduler.config.deterministic else logging.WARNING
            log.log(level, "audit: request %s diverged from its cold re-run at generated token "
                    "%d (largest logprob difference %.3g; shortcuts: %s)%s", found.request_id,
                    found.position, found.max_logprob_diff, ", ".join(found.shortcuts),
                    " -- a bug under --deterministic" if level == logging.ERROR else "")

    def _log_progress(self, every: float = 10.0) -> None:
        """A line every `every` seconds of activity: throughput, queues and where step time went
        (the statistics SchedulerStats declares with a log label)."""
        now, s = time.monotonic(), self.stats
        then, old = self._logged
        if now - then < every:
            return
        log.info("%s", progress_line(old, s, now - then))
        self._logged = (now, msgspec.structs.replace(s))

    def _await_result(self, step_id: int) -> StepResult:
        while step_id not in self.results:
            msg = self.decode(self.inbound.recv())
            if isinstance(msg, StepResult):
                self.results[msg.step_id] = msg
            else:
                self.pending.append(msg)
        return self.results.pop(step_id)

    def _stats(self):
        fresh = self.scheduler.stats()
        for name in ("schedule_seconds", "update_seconds", "wait_seconds", "forward_seconds",
                     "sample_seconds"):
            setattr(fresh, name, getattr(self.stats, name))
        if self.publisher is not None:
            fresh.kv_events_dropped = self.publisher.dropped
        self.stats = fresh
        return fresh


def main(ctx: ChildContext) -> None:
    loop = SchedulerLoop(ctx)

    def on_sigterm(signum, frame) -> None:
        if loop.planning:  # a plan is being built: it goes out first (it may hold saves)
            loop.stop_requested = True
        else:
            loop.stop()

    signal.signal(signal.SIGTERM, on_sigterm)
    ctx.ready(num_kv_blocks=str(loop.scheduler.allocator.num_blocks))
    loop.run()
