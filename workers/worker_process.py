"""The worker actor: loads the model and KV cache, then runs every StepPlan it is sent.

Its loop is plain blocking ZeroMQ: a worker does one thing at a time and must not share its
cores with an event loop. With tensor parallelism every rank runs every plan on its shard of the
model (torch.distributed between them); only rank 0 answers the scheduler.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading

import msgspec
import torch

from deepinfer.engine import envs
from deepinfer.engine.protocol import (
    CompileGrammar,
    GrammarReady,
    LoRAUpdate,
    Shutdown,
    WorkerInbound,
)
from deepinfer.engine.runtime.ipc import plan_receiver, push
from deepinfer.engine.runtime.process_entry import ChildContext

log = logging.getLogger("deepinfer.worker")

_SHUTDOWN_GRACE = 1.5  # seconds a signalled rank waits for its scheduler's Shutdown


def _threads(ctx: ChildContext) -> int:
    explicit = ctx.config.worker_threads or envs.worker_threads()
    if explicit:
        return explicit
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // ctx.config.tensor_parallel_size)


def main(ctx: ChildContext) -> None:
    from deepinfer.workers.device import resolve_device
    from deepinfer.workers.distributed.parallel_state import init_tensor_parallel
    from deepinfer.workers.memory_report import memory_line
    from deepinfer.workers.model_runner import ModelRunner

    torch.set_num_threads(_threads(ctx))
    device = resolve_device(ctx.config, ctx.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_tensor_parallel(ctx.rank, ctx.config.tensor_parallel_size, ctx.endpoints.dist_init,
                         ctx.config.enable_expert_parallel, device)
    runner = ModelRunner(ctx.config, device,
                         transport=(ctx.zmq, ctx.rank, ctx.endpoints.scheduler_in))
    # Stopping: the scheduler, signalled too, sends its last plan (the disk tier's last saves)
    # and Shutdown; a rank whose scheduler is gone stops on its own shortly after. Either way
    # the connectors first finish what must not be lost (queued writes).
    def stop_soon(*_) -> None:
        timer = threading.Timer(_SHUTDOWN_GRACE, lambda: (runner.close(), os._exit(0)))
        timer.daemon = True  # a rank that got its Shutdown exits at once
        timer.start()

    signal.signal(signal.SIGTERM, stop_soon)
    inbound = plan_receiver(ctx.zmq, ctx.endpoints.workers_in[ctx.rank],
                               envs.cluster_secret())
    to_scheduler = push(ctx.zmq, ctx.endpoints.scheduler_in) if ctx.rank == 0 else None
    decode = msgspec.msgpack.Decoder(WorkerInbound).decode
    encode = msgspec.msgpack.Encoder().encode
    info = {"num_kv_blocks": str(runner.num_blocks)}
    if runner.lora is not None:  # the adapters' load times, for the server's metric
        info["lora_load_seconds"] = json.dumps(runner.lora.load_seconds)
    for connector in runner.connectors:
        info |= connector.ready_info()
    log.info("rank %d ready on %s: %d KV blocks (%s), %d threads", ctx.rank, device,
             runner.num_blocks, ctx.config.kv_dtype(), torch.get_num_threads())
    log.info("rank %d %s", ctx.rank, memory_line(runner.model, runner.kv_caches))
    ctx.ready(**info)
    send_lock = threading.Lock()  # grammar answers come from the compile threads

    def grammar_ready(request_id: str, error: str | None) -> None:
        if to_scheduler is not None:
            with send_lock:
                to_scheduler.send(encode(GrammarReady(request_id, error)))

    while True:
        msg = decode(inbound.recv())
        if isinstance(msg, Shutdown):
            runner.close()  # e.g. the disk tier's queued writes
            return
        if isinstance(msg, CompileGrammar):
            runner.compile_grammar(msg, grammar_ready)
            continue
        if isinstance(msg, LoRAUpdate):
            answer = runner.update_lora(msg)
            if answer is not None and to_scheduler is not None:
                with send_lock:
                    to_scheduler.send(encode(answer))
            continue
        result = runner.execute(msg)
        if to_scheduler is not None:
            with send_lock:
                to_scheduler.send(encode(result))
