"""Publishes KV event batches over ZeroMQ as vLLM does, off the scheduler's step loop.

Wire protocol (what vLLM's consumers speak):
- PUB on `endpoint`: one multipart message per batch, `[topic, seq, payload]`; seq counts batches
  from 0 as 8 bytes big-endian; payload is the msgpack batch (engine/kvcache/kv_events.py).
- ROUTER on `replay_endpoint`: a subscriber that saw a gap (or joined late) sends the first seq
  it wants as 8 bytes big-endian (from a REQ or DEALER: `[b"", seq]`); it gets each buffered
  batch from that seq on as `[b"", seq, payload]`, then `[b"", -1 as 8 signed bytes, b""]`.

The step loop only puts batches on a queue (and rings an inproc doorbell so the thread sleeps
in one poll, never spinning); one background thread owns the PUB and ROUTER sockets (ZeroMQ
sockets are not thread-safe) and does the encoding, sending and replaying.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections import deque

import msgspec
import zmq

from deepinfer.engine.config import KVEventsConfig
from deepinfer.engine.kvcache.kv_events import KVEventBatch
from deepinfer.engine.model_config import ModelConfigError

log = logging.getLogger("deepinfer.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
# A replay request is `[b"", 8 bytes]`: anything larger is refused by ZeroMQ before it is
# buffered (the peer is dropped), so no client can make the scheduler hold its message.
MAX_REPLAY_REQUEST = 64
# Replay requests answered per wake-up: a flood of them waits its turn behind new batches.
REPLAYS_PER_WAKE = 4
_bells = itertools.count()


class EventPublisherError(ModelConfigError):
    """The user's to fix (a port already taken): reported in one line, no traceback."""


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(config.max_queue_size)
        self._ready = threading.Event()
        self._error: Exception | None = None
        self.dropped = 0  # batches the full queue refused (a stuck thread; never blocks steps)
        self._bell_addr = f"inproc://kv-events-bell-{next(_bells)}"
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:  # a clear start-up error: the port is taken, say
            raise EventPublisherError(
                f"--kv-events-config: cannot bind {config.endpoint} / {config.replay_endpoint}: "
                f"{self._error}")
        # The doorbell's ringing end: only the caller's thread (the step loop) touches it.
        self._bell = zmq.Context.instance().socket(zmq.PUSH)
        self._bell.set_hwm(1)  # one pending ring wakes the thread for everything queued
        self._bell.connect(self._bell_addr)

    def publish(self, batch: KVEventBatch) -> None:
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1  # never block a step; seqs are given as batches are sent
            return
        self._ring()

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (up to `timeout`), then close the sockets."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._ring()
        self._thread.join(timeout)
        self._bell.close(0)

    def _ring(self) -> None:
        try:
            self._bell.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass  # a ring is already pending

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        bell = ctx.socket(zmq.PULL)
        bell.bind(self._bell_addr)
        pub = ctx.socket(zmq.PUB)
        replay = ctx.socket(zmq.ROUTER) if self.config.replay_endpoint else None
        try:
            pub.set_hwm(self.config.hwm)
            pub.bind(self.config.endpoint)
            if replay is not None:
                replay.setsockopt(zmq.MAXMSGSIZE, MAX_REPLAY_REQUEST)
                replay.bind(self.config.replay_endpoint)
        except zmq.ZMQError as e:
            self._error = e
            bell.close(0)
            pub.close(0)
            if replay is not None:
                replay.close(0)
            self._ready.set()
            return
        self._ready.set()
        topic = self.config.topic.encode()
        encode = msgspec.msgpack.Encoder().encode
        buffer: deque[tuple[int, bytes]] = deque(maxlen=self.config.buffer_steps)
        seq = 0
        poller = zmq.Poller()
        poller.register(bell, zmq.POLLIN)
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())  # a ring or a replay request; sleeps otherwise
                if bell in ready:
                    while bell.poll(0):
                        bell.recv()
                while True:  # everything queued, in order
                    try:
                        batch = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if batch is None:
                        return
                    payload = encode(batch)
                    pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                    buffer.append((seq, payload))
                    seq += 1
                if replay is not None and replay in ready:
                    self._serve_replay(replay, buffer)
        finally:
            bell.close(0)
            pub.close(linger=200)
            if replay is not None:
                replay.close(0)

    @staticmethod
    def _serve_replay(replay: zmq.Socket, buffer: deque[tuple[int, bytes]]) -> None:
        """Answer up to REPLAYS_PER_WAKE waiting requests (the poll wakes again for more)."""
        for _ in range(REPLAYS_PER_WAKE):
            if not replay.poll(0):
                return
            frames = replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("ignoring a malformed KV events replay request (%d frames)",
                            len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in buffer:
                if seq >= first:
                    replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            replay.send_multipart((client, b"", END_SEQ, b""))
