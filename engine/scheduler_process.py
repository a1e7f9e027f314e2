"""The scheduler actor: requests in from the tokenizer, step plans out to the workers."""

from __future__ import annotations

import logging

import msgspec
import zmq

from engine.ipc import pull, push
from engine.process_entry import ChildContext
from engine.protocol import Abort, StepPlan, StepResult, TokenBatch, TokenizedRequest
from engine.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger("deepinfer.scheduler")

Inbound = TokenizedRequest | Abort | StepResult


def build_scheduler(ctx: ChildContext) -> Scheduler:
    cfg = ctx.config
    info = cfg.model_info()
    return Scheduler(SchedulerConfig(
        num_blocks=cfg.kv_blocks(),
        block_size=cfg.block_size,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        prefill_chunk_size=cfg.prefill_chunk_size,
        context_len=cfg.context_len(),
        eos_token_ids=info.eos_token_ids,
    ))


def main(ctx: ChildContext) -> None:
    scheduler = build_scheduler(ctx)
    inbound = pull(ctx.zmq, ctx.endpoints.scheduler_in)
    to_tokenizer = push(ctx.zmq, ctx.endpoints.tokenizer_in)
    to_workers = [push(ctx.zmq, addr) for addr in ctx.endpoints.workers_in]
    decode = msgspec.msgpack.Decoder(Inbound).decode
    encode = msgspec.msgpack.Encoder().encode
    pending: list = []  # requests/aborts that arrived while a step ran
    ctx.ready(num_kv_blocks=str(scheduler.allocator.num_blocks))

    def handle(msgs: list) -> None:
        errors = []
        for msg in msgs:
            if isinstance(msg, TokenizedRequest):
                err = scheduler.add(msg)
                if err is not None:
                    errors.append(err)
            elif isinstance(msg, Abort):
                scheduler.abort(msg.request_ids)
        # Always report: rejections, and freed blocks after aborts, show up right away.
        to_tokenizer.send(encode(TokenBatch(errors, scheduler.stats())))

    while True:
        msgs, pending = pending, []
        if not msgs and not scheduler.has_work():
            msgs.append(decode(inbound.recv()))  # idle: block, never spin
        while inbound.poll(0):
            msgs.append(decode(inbound.recv(zmq.NOBLOCK)))
        if msgs:
            handle(msgs)
        step = scheduler.schedule()
        if step is None:
            if scheduler.has_work():  # nothing fits right now: wait for news, do not spin
                pending.append(decode(inbound.recv()))
            continue
        payload = encode(step.plan)
        for sock in to_workers:
            sock.send(payload)
        result = _await_result(inbound, decode, step.plan, pending)
        deltas = scheduler.update(step, result)
        to_tokenizer.send(encode(TokenBatch(deltas, scheduler.stats())))


def _await_result(inbound: zmq.Socket, decode, plan: StepPlan, pending: list) -> StepResult:
    while True:
        msg = decode(inbound.recv())
        if isinstance(msg, StepResult):
            if msg.step_id != plan.step_id:
                raise RuntimeError(f"expected result of step {plan.step_id}, got {msg.step_id}")
            return msg
        pending.append(msg)
