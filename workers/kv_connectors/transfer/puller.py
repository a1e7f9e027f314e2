"""Decode side of a KV transfer: per worker rank, a small pool of threads that pull requests'
prompt blocks from the matching rank of a prefill server into the blocks the scheduler
allocated here, then release them there and report to the scheduler
(engine/kvcache/transfer.py).

The blocks a pull writes belong to no running request until it reports, so the step loop may run
forwards meanwhile. Pulls run concurrently, each with its own deadline: one that gets no answer
for `timeout` seconds fails its request with that reason (a dead prefill server) without
holding up the others; a pull stops early when its request is aborted. Every message is
authenticated both ways with the cluster secret (engine/kv_transfer_wire.py). A prefill rank
that has not yet heard of the transfer (its plan is on the way) says so, and the pull asks
again until its deadline.

With the NIXL backend the blocks do not come over the socket: the thread READs them itself
(nixl_transport.py), between two checks of the transfer by the prefill rank.
"""

from __future__ import annotations

import hmac
import itertools
import queue
import threading
import time
import uuid
import warnings
from collections.abc import Callable

import msgspec
import numpy as np
import torch
import zmq

from deepinfer.engine.kv_transfer_wire import (
    Meta,
    Read,
    ReadReply,
    Release,
    reply_mac,
    seal_request,
    split_address,
)
from deepinfer.engine.protocol import KVPull, KVTransferDone, pack_ids, unpack_ids
from deepinfer.engine.runtime.ipc import push

# Pulls in flight at once per rank: enough that a few dead prefill servers waiting out their
# deadlines leave the others flowing; each holds a socket per prefill rank it talks to.
MAX_CONCURRENT_PULLS = 8
_MAX_REPLY_HEADER = 16 << 20
_RETRY_SECONDS = 0.01  # between two asks for a transfer the prefill rank does not hold yet


class _Stop(Exception):
    """A pull ends early (cancelled or timed out) with this report."""

    def __init__(self, done: KVTransferDone) -> None:
        super().__init__(done.error)
        self.done = done


class KVPuller:
    def __init__(self, zctx: zmq.Context, tensors: list[list[torch.Tensor]], rank: int,
                 report_to: str, timeout: float, secret: bytes, backend: str = "zmq") -> None:
        self.zctx, self.tensors, self.rank = zctx, tensors, rank
        self.timeout, self.secret = timeout, secret
        self.on_gpu = any(t.is_cuda for ts in tensors for t in ts)
        # A reply's largest frame: one cache tensor's blocks (at most all of ours), or a header
        # (a NIXL agent's metadata).
        self.max_reply = max([_MAX_REPLY_HEADER, *(t.nbytes for ts in tensors for t in ts)])
        self.jobs: queue.Queue[KVPull] = queue.Queue()
        self.lock = threading.Lock()
        self.active: set[str] = set()  # requests with a pull submitted and not yet reported
        self.cancelled: set[str] = set()
        self.encode = msgspec.msgpack.Encoder().encode
        # Shared by the pulling threads, under its own lock (a send may wait for the scheduler).
        self.report = push(zctx, report_to)
        self.report_lock = threading.Lock()
        self.local = threading.local()  # each thread's sockets, by prefill endpoint
        self.seqs = itertools.count(1)
        self.nixl = self.nixl_lock = None
        if backend == "nixl":
            from deepinfer.workers.kv_connectors.transfer.nixl_transport import NixlSink

            self.nixl = NixlSink(tensors, f"deepinfer-decode-{uuid.uuid4().hex[:12]}-{rank}")
            self.nixl_lock = threading.Lock()
        # Daemons: a pull waiting out its deadline never holds up the worker's exit.
        for i in range(MAX_CONCURRENT_PULLS):
            threading.Thread(target=self._serve, name=f"deepinfer-kv-puller-{i}",
                             daemon=True).start()

    def submit(self, pulls: list[KVPull]) -> None:
        with self.lock:
            self.active.update(p.request_id for p in pulls)
        for pull in pulls:
            self.jobs.put(pull)

    def cancel(self, request_ids: list[str]) -> None:
        """Requests that ended: stop their pulls, if any."""
        with self.lock:
            self.cancelled.update(r for r in request_ids if r in self.active)

    def _is_cancelled(self, request_id: str) -> bool:
        with self.lock:
            return request_id in self.cancelled

    def _serve(self) -> None:
        while True:
            self._run(self.jobs.get())

    def _run(self, pull: KVPull) -> None:
        t0 = time.perf_counter()
        try:
            done = self._pull(pull)
        except Exception as exc:  # a bad answer must fail the request, not the thread
            done = KVTransferDone(pull.request_id, self.rank,
                                  error=f"{type(exc).__name__}: {exc}")
        done.seconds = time.perf_counter() - t0
        with self.lock:
            self.active.discard(pull.request_id)
            self.cancelled.discard(pull.request_id)
        with self.report_lock:
            self.report.send(self.encode(done))

    def _socket(self, endpoint: str) -> zmq.Socket:
        sockets = self.local.__dict__.setdefault("sockets", {})
        sock = sockets.get(endpoint)
        if sock is None:
            sock = self.zctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_reply)  # a bigger frame: dropped unread
            sock.connect(endpoint)
            sockets[endpoint] = sock
        return sock

    def _drop_socket(self, endpoint: str) -> None:
        """After a timeout: what was queued for a dead peer must not reach a later one."""
        self.local.sockets.pop(endpoint).close(0)

    def _pull(self, pull: KVPull) -> KVTransferDone:
        rid = pull.request_id
        endpoint, nonce = split_address(pull.addresses[self.rank])
        sock = self._socket(endpoint)
        pairs = [unpack_ids(b).reshape(-1, 2) for b in pull.blocks]
        release = lambda cancelled=False: sock.send_multipart(  # noqa: E731
            seal_request(self.secret, nonce, self.encode(Release(pull.transfer_id, cancelled))),
            zmq.NOBLOCK)
        if pull.abandon or self._is_cancelled(rid):
            release(True)
            return KVTransferDone(rid, self.rank, cancelled=True)
        payload = self.nixl is None
        request = Read(0, nonce, pull.transfer_id, [pack_ids(p[:, 0]) for p in pairs], payload)
        try:
            if self.nixl is not None:
                error = self._nixl_peer(sock, endpoint, nonce, rid, release)
                if error is not None:
                    return KVTransferDone(rid, self.rank, error=error)
            reply, frames = self._ask(sock, endpoint, nonce, rid, request, release)
            if reply.error is not None:
                return KVTransferDone(rid, self.rank, error=reply.error)
            if payload:
                nbytes = self._write(pairs, frames)
            else:
                nbytes = self._read_nixl(endpoint, rid, pairs, release)
                # Released while we read (its hold timed out)? Then it may have been overwritten.
                check = Read(0, nonce, pull.transfer_id, [], payload=False)
                reply, _ = self._ask(sock, endpoint, nonce, rid, check, release)
                if reply.error is not None:
                    return KVTransferDone(rid, self.rank, error=reply.error)
        except _Stop as stop:
            return stop.done
        if self.on_gpu:  # the copies must have landed before the scheduler hears of them
            torch.cuda.synchronize()
        release()
        return KVTransferDone(rid, self.rank, blocks=len(pairs[0]) if pairs else 0,
                              bytes=nbytes)

    def _nixl_peer(self, sock: zmq.Socket, endpoint: str, nonce: str, rid: str,
                   release: Callable[[bool], None]) -> str | None:
        """Learn the prefill rank's NIXL metadata once; an error, or None."""
        with self.nixl_lock:
            if self.nixl.knows(endpoint, nonce):
                return None
        reply, _ = self._ask(sock, endpoint, nonce, rid, Meta(0, nonce), release)
        if reply.error is not None:
            return reply.error
        with self.nixl_lock:
            self.nixl.add_peer(endpoint, nonce, reply.meta)
        return None

    def _ask(self, sock: zmq.Socket, endpoint: str, nonce: str, rid: str, msg: Read | Meta,
             release: Callable[[bool], None]) -> tuple[ReadReply, list]:
        """Send a request to the prefill rank and wait for its authenticated answer (reply,
        block frames); ask again while the rank does not hold the transfer yet."""
        deadline = time.monotonic() + self.timeout
        not_held = None  # the rank's last answer that it does not hold the transfer yet
        while True:
            msg.seq = next(self.seqs)
            sealed = seal_request(self.secret, nonce, self.encode(msg))
            sock.send_multipart(sealed, zmq.NOBLOCK)
            try:
                reply, frames = self._answer(sock, endpoint, nonce, rid, msg.seq, sealed[1],
                                             deadline, release)
            except _Stop as stop:
                if not_held is None or stop.done.cancelled:
                    raise
                return not_held, []  # it answered, only never with the transfer: say so
            if not reply.retry or time.monotonic() + _RETRY_SECONDS > deadline:
                return reply, frames  # a transfer still not held fails with that reason
            not_held = reply
            time.sleep(_RETRY_SECONDS)

    def _answer(self, sock: zmq.Socket, endpoint: str, nonce: str, rid: str, seq: int,
                request_mac: bytes, deadline: float, release: Callable[[bool], None]
                ) -> tuple[ReadReply, list]:
        while True:
            if self._is_cancelled(rid):
                release(True)
                raise _Stop(KVTransferDone(rid, self.rank, cancelled=True))
            if time.monotonic() > deadline:
                self._drop_socket(endpoint)
                raise _Stop(KVTransferDone(rid, self.rank, error=(
                    f"no answer from the prefill server's rank {self.rank} at {endpoint} within "
                    f"{self.timeout:g} s")))
            if not sock.poll(50):
                continue
            frames = sock.recv_multipart(copy=False)
            header = frames[0].bytes
            reply = msgspec.msgpack.decode(header, type=ReadReply)
            good = len(frames) >= 2 and hmac.compare_digest(
                frames[1].bytes, reply_mac(self.secret, nonce, request_mac, header))
            if good and reply.seq == seq:
                return reply, frames[2:]  # older replies belong to abandoned requests
            if not good and reply.seq == -1:
                raise _Stop(KVTransferDone(rid, self.rank, error=reply.error))

    def _read_nixl(self, endpoint: str, rid: str, pairs: list[np.ndarray],
                   release: Callable[[bool], None]) -> int:
        """READ the blocks with NIXL; returns the bytes read."""
        with self.nixl_lock:
            read = self.nixl.read(endpoint, pairs)
        if read is None:
            return 0
        deadline = time.monotonic() + self.timeout
        try:
            while not read.done():
                if self._is_cancelled(rid):
                    raise _Stop(KVTransferDone(rid, self.rank, cancelled=True))
                if time.monotonic() > deadline:
                    raise _Stop(KVTransferDone(rid, self.rank, error=(
                        f"the NIXL read from the prefill server's rank {self.rank} at "
                        f"{endpoint} did not finish within {self.timeout:g} s")))
                time.sleep(0.0002)
        except BaseException:
            read.close()  # before we report: no write into our blocks may follow
            release(True)
            raise
        read.close()
        return read.nbytes

    def _write(self, pairs: list[np.ndarray], frames: list) -> int:
        """Copy the received blocks into ours; returns the bytes taken."""
        expected = sum(len(ts) for ts in self.tensors)
        if len(frames) != expected:
            raise ValueError(f"{len(frames)} tensors received, {expected} expected (a different "
                             "model or tensor-parallel size?)")
        k = nbytes = 0
        for tensors, p in zip(self.tensors, pairs):
            if not len(p):  # this server's prefix cache had all of this group's blocks
                k += len(tensors)
                continue
            index = torch.from_numpy(p[:, 1].astype(np.int64))
            for t in tensors:
                buf = frames[k].buffer
                k += 1
                block = t[0].numel() * t.element_size()
                if len(buf) != len(p) * block:
                    raise ValueError(f"{len(buf)} bytes received for {len(p)} blocks of "
                                     f"{block} (a different model or dtype?)")
                with warnings.catch_warnings():  # read-only frames: we only read them
                    warnings.simplefilter("ignore", UserWarning)
                    src = torch.frombuffer(buf, dtype=torch.uint8)
                src = src.view(t.dtype).view(len(p), *t.shape[1:])
                t.index_copy_(0, index.to(t.device), src.to(t.device))
                nbytes += len(buf)
        return nbytes
