"""Decode side of a KV transfer: a thread per worker rank that pulls a request's prompt blocks
from the matching rank of a prefill server into the blocks the scheduler allocated here, then
releases them there and reports to the scheduler (engine/kvcache/transfer.py).

The blocks it writes belong to no running request until it reports, so the step loop may run
forwards meanwhile. A pull gives up after `timeout` seconds without an answer (a dead prefill
server fails the request with that reason), and stops early when the request is aborted.
"""

from __future__ import annotations

import queue
import threading
import time
import warnings

import msgspec
import numpy as np
import torch
import zmq

from engine.protocol import KVPull, KVTransferDone, pack_ids, unpack_ids
from engine.runtime.ipc import push
from workers.kv_transfer.wire import Read, ReadReply, Release, split_address


class KVPuller(threading.Thread):
    def __init__(self, zctx: zmq.Context, tensors: list[list[torch.Tensor]], rank: int,
                 report_to: str, timeout: float) -> None:
        super().__init__(name="deepinfer-kv-puller", daemon=True)
        self.zctx, self.tensors, self.rank = zctx, tensors, rank
        self.report_to, self.timeout = report_to, timeout
        self.jobs: queue.Queue[KVPull] = queue.Queue()
        self.lock = threading.Lock()
        self.active: set[str] = set()  # requests with a pull submitted and not yet reported
        self.cancelled: set[str] = set()
        self.encode = msgspec.msgpack.Encoder().encode
        self.sockets: dict[str, zmq.Socket] = {}
        self.seq = 0

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

    def run(self) -> None:
        report = push(self.zctx, self.report_to)
        while True:
            pull = self.jobs.get()
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
            report.send(self.encode(done))

    def _socket(self, endpoint: str) -> zmq.Socket:
        sock = self.sockets.get(endpoint)
        if sock is None:
            sock = self.zctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self.sockets[endpoint] = sock
        return sock

    def _drop_socket(self, endpoint: str) -> None:
        """After a timeout: what was queued for a dead peer must not reach a later one."""
        self.sockets.pop(endpoint).close(0)

    def _pull(self, pull: KVPull) -> KVTransferDone:
        rid = pull.request_id
        endpoint, nonce = split_address(pull.addresses[self.rank])
        sock = self._socket(endpoint)
        pairs = [unpack_ids(b).reshape(-1, 2) for b in pull.blocks]
        release = lambda cancelled=False: sock.send(  # noqa: E731
            self.encode(Release(pull.transfer_id, cancelled)), zmq.NOBLOCK)
        if self._is_cancelled(rid):
            release(True)
            return KVTransferDone(rid, self.rank, cancelled=True)
        self.seq += 1
        sock.send(self.encode(Read(self.seq, nonce, pull.transfer_id,
                                   [pack_ids(p[:, 0]) for p in pairs])), zmq.NOBLOCK)
        deadline = time.monotonic() + self.timeout
        while True:
            if self._is_cancelled(rid):
                release(True)
                return KVTransferDone(rid, self.rank, cancelled=True)
            if time.monotonic() > deadline:
                self._drop_socket(endpoint)
                return KVTransferDone(rid, self.rank, error=(
                    f"no answer from the prefill server's rank {self.rank} at {endpoint} within "
                    f"{self.timeout:g} s"))
            if not sock.poll(50):
                continue
            frames = sock.recv_multipart(copy=False)
            reply = msgspec.msgpack.decode(frames[0].bytes, type=ReadReply)
            if reply.seq == self.seq:
                break  # older replies belong to abandoned reads
        if reply.error is not None:
            return KVTransferDone(rid, self.rank, error=reply.error)
        nbytes = self._write(pairs, frames[1:])
        if any(t.is_cuda for ts in self.tensors for t in ts):
            torch.cuda.synchronize()
        release()
        return KVTransferDone(rid, self.rank, blocks=len(pairs[0]) if pairs else 0,
                              bytes=nbytes)

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
