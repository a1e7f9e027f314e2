"""The asyncio face of a running engine, used by the API server.

It owns the launcher, sends GenerateRequest/Abort to the tokenizer process and routes each
RequestOutput to the request's queue. A request whose consumer stops listening (client
disconnect, cancellation) is aborted in every process.

The output reader is the only way answers come back: a frame it cannot decode is logged and
dropped (the reader goes on), and a reader that ends anyway fails the engine exactly as a dead
process does (pending requests get their error, /health turns 503, the server exits), never
silently (a server whose reader died used to stay healthy and answer nothing).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import msgspec
import zmq
import zmq.asyncio

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.protocol import (
    Abort,
    FinishReason,
    GenerateRequest,
    LoRAUpdate,
    LoRAUpdated,
    OutputBatch,
    RequestOutput,
    SchedulerStats,
)
from deepinfer.engine.runtime.ipc import Endpoints, pull
from deepinfer.engine.runtime.launcher import Launcher

log = logging.getLogger("deepinfer.client")


class EngineDeadError(RuntimeError):
    pass


class AsyncEngineClient:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_name = config.model_name()
        self.context_len = config.context_len()
        self.stats = SchedulerStats()
        self.dead_reason: str | None = None
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._lora_answers: dict[str, asyncio.Future[LoRAUpdated]] = {}
        self._endpoints = Endpoints.create(config.tensor_parallel_size, config.dist_address())
        self._zmq = zmq.asyncio.Context()
        self._in = pull(self._zmq, self._endpoints.client_in)
        self._out = self._zmq.socket(zmq.PUSH)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.connect(self._endpoints.tokenizer_in)
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(OutputBatch).decode
        self.launcher = Launcher(config, self._endpoints)
        # Prefill/decode disaggregation: this server's role, and (prefill) where each worker
        # rank serves KV to decode servers.
        self.disaggregation_mode = config.disaggregation_mode
        self.worker_ranks = config.tensor_parallel_size
        self.kv_transfer_addresses: list[str] = []
        self.lora_load_seconds: dict[str, float] = {}
        self._reader: asyncio.Task | None = None
        self._on_failure = None
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, on_failure=None) -> None:
        """Start the engine processes (blocking work runs in a thread) and the output reader."""
        self._loop = asyncio.get_running_loop()
        try:
            await asyncio.to_thread(self.launcher.start)
        except BaseException:
            # Nothing will use them: closed now, a context collected later has nothing to wait
            # for (its term() blocks on open sockets, hanging whoever collects it).
            self._close()
            raise
        if self.disaggregation_mode == "prefill":  # one node (checked): every rank reported here
            self.kv_transfer_addresses = [self.launcher.ready_info[f"worker{r}"]["kv_transfer"]
                                          for r in range(self.worker_ranks)]
        ready = self.launcher.ready_info.get("worker0", {})
        # Seconds each --lora-modules adapter took to load (the server's metric).
        self.lora_load_seconds = json.loads(ready.get("lora_load_seconds", "{}"))
        self._on_failure = on_failure
        self._reader = asyncio.create_task(self._read_outputs())
        self._reader.add_done_callback(self._reader_ended)

        def failed(reason: str) -> None:  # the supervisor's thread
            self.dead_reason = reason
            self._loop.call_soon_threadsafe(self._failed, reason)

        self.launcher.supervise(failed)

    @property
    def healthy(self) -> bool:
        reading = self._reader is not None and not self._reader.done()
        return self.dead_reason is None and reading and self.launcher.alive()

    def _failed(self, reason: str) -> None:
        self._fail_all(reason)
        if self._on_failure is not None:
            self._on_failure(reason)

    def _reader_ended(self, task: asyncio.Task) -> None:
        if self._stopping or self.dead_reason is not None:  # shut down, or failed already
            return
        exc = None if task.cancelled() else task.exception()
        why = repr(exc) if exc is not None else "cancelled"
        log.error("the engine output reader stopped (%s); failing the engine", why,
                  exc_info=exc)
        self._failed(f"engine output reader stopped: {why}")

    def _fail_all(self, reason: str) -> None:
        self.dead_reason = reason
        for rid, queue in self._queues.items():
            queue.put_nowait(RequestOutput(
                rid, finish_reason=FinishReason.ERROR, error=f"engine failed: {reason}"))
        for rid, answer in self._lora_answers.items():
            if not answer.done():
                answer.set_result(LoRAUpdated(rid, f"engine failed: {reason}"))

    async def _read_outputs(self) -> None:
        while True:
            frame = await self._in.recv()
            try:
                batch = self._decode(frame)
            except msgspec.MsgspecError as exc:  # a bug or a stranger: not a reason to stop
                log.error("dropped a malformed engine output frame (%d bytes): %s",
                          len(frame), exc)
                continue
            if batch.stats is not None:
                self.stats = batch.stats
            for out in batch.outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
            for answer in batch.lora_updates:
                waiter = self._lora_answers.get(answer.request_id)
                if waiter is not None and not waiter.done():
                    waiter.set_result(answer)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until one carries a finish_reason."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        rid = request.request_id
        if rid in self._queues:
            raise ValueError(f"request id {rid!r} is already in flight")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[rid] = queue
        finished = False
        try:
            await self._out.send(self._encode(request))
            while True:
                out = await queue.get()
                finished = out.finish_reason is not None
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
            if not finished:
                await self.abort([rid])

    async def update_lora(self, update: LoRAUpdate) -> LoRAUpdated:
        """Load or unload a LoRA adapter; the engine's answer (its error names a problem). An
        unload returns once no request uses the adapter any more."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        answer: asyncio.Future[LoRAUpdated] = asyncio.get_running_loop().create_future()
        self._lora_answers[update.request_id] = answer
        try:
            await self._out.send(self._encode(update))
            return await answer
        finally:
            del self._lora_answers[update.request_id]

    async def abort(self, request_ids: list[str]) -> None:
        if self.dead_reason is None:
            await self._out.send(self._encode(Abort(request_ids)))

    async def shutdown(self) -> None:
        self._stopping = True
        if self._reader is not None:
            self._reader.cancel()
        # Blocking on purpose (a few seconds at most): at interpreter exit no executor is left.
        self.launcher.shutdown()
        self._close()

    def _close(self) -> None:
        self._in.close(0)
        self._out.close(0)
