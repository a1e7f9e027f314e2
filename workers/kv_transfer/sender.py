"""Prefill side of a KV transfer: a thread per worker rank that serves the blocks of held
prompts to decode servers' ranks, and reports to the scheduler when a decode side is done.

Which blocks are held is the scheduler's business (engine/kvcache/transfer.py); the thread only
refuses transfers the scheduler has released since (`release`, called by the step loop before a
plan's forward, under the same lock as a read: once it returns no read of them is under way, so
their blocks may be overwritten).

With the NIXL backend the thread also owns a NIXL agent (nixl_transport.py): decode ranks read
the blocks themselves and only ask it for its `Meta` and to check transfers.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict

import msgspec
import numpy as np
import torch
import zmq

from engine.protocol import KVTransferDone, unpack_ids
from engine.runtime.ipc import push
from workers.kv_transfer.wire import Meta, Read, ReadReply, ToSender, as_bytes

log = logging.getLogger("deepinfer.kv_transfer")
_REMEMBER_RELEASED = 65536  # released transfer ids kept to refuse late reads


class KVSender(threading.Thread):
    def __init__(self, zctx: zmq.Context, tensors: list[list[torch.Tensor]], host: str,
                 rank: int, report_to: str, backend: str = "zmq") -> None:
        super().__init__(name="deepinfer-kv-sender", daemon=True)
        self.zctx, self.tensors, self.rank, self.report_to = zctx, tensors, rank, report_to
        self.sock = zctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.nonce = uuid.uuid4().hex[:12]
        self.address = f"tcp://{host}:{port}#{self.nonce}"
        self.lock = threading.Lock()
        self.released: OrderedDict[str, None] = OrderedDict()
        self.progress: dict[str, list] = {}  # transfer id -> [first read at, blocks, bytes]
        self.nixl = None
        if backend == "nixl":
            from workers.kv_transfer.nixl_transport import NixlSource

            self.nixl = NixlSource(tensors, f"deepinfer-prefill-{self.nonce}-{rank}")

    def release(self, transfer_ids: list[str]) -> None:
        with self.lock:
            for tid in transfer_ids:
                self.released[tid] = None
                self.progress.pop(tid, None)
            while len(self.released) > _REMEMBER_RELEASED:
                self.released.popitem(last=False)

    def run(self) -> None:
        report = push(self.zctx, self.report_to)
        decode = msgspec.msgpack.Decoder(ToSender).decode
        encode = msgspec.msgpack.Encoder().encode
        while True:
            ident, header = self.sock.recv_multipart()[:2]
            msg = decode(header)
            if isinstance(msg, Read):
                try:
                    reply, frames = self._read(msg)
                except Exception as exc:  # answer it: a dead thread would hang every pull
                    log.exception("KV read failed")
                    reply, frames = ReadReply(msg.seq, f"{type(exc).__name__}: {exc}"), []
                self.sock.send_multipart([ident, encode(reply), *frames], copy=False)
                continue
            if isinstance(msg, Meta):
                self.sock.send_multipart([ident, encode(self._meta(msg))])
                continue
            with self.lock:
                first, blocks, nbytes = self.progress.pop(msg.transfer_id,
                                                          (time.perf_counter(), 0, 0))
            report.send(encode(KVTransferDone(
                msg.transfer_id, self.rank, blocks, nbytes, time.perf_counter() - first,
                cancelled=msg.cancelled)))

    def _meta(self, msg: Meta) -> ReadReply:
        if msg.nonce != self.nonce:
            return ReadReply(msg.seq, "the prefill server restarted; its KV is gone")
        if self.nixl is None:
            return ReadReply(msg.seq, "the prefill server moves KV over ZeroMQ "
                                      "(--kv-transfer-backend zmq), not NIXL")
        return ReadReply(msg.seq, meta=self.nixl.meta)

    def _read(self, msg: Read) -> tuple[ReadReply, list]:
        if msg.nonce != self.nonce:
            return ReadReply(msg.seq, "the prefill server restarted; its KV is gone"), []
        t0 = time.perf_counter()
        frames, nbytes = [], 0
        with self.lock:
            if msg.transfer_id in self.released:
                return ReadReply(msg.seq, f"transfer {msg.transfer_id} was released (its hold "
                                          "timed out, or it was pulled already)"), []
            for tensors, ids in zip(self.tensors, msg.blocks):
                index = torch.from_numpy(unpack_ids(ids).astype(np.int64))
                if len(index) and (int(index.min()) < 0 or
                                   int(index.max()) >= (tensors[0].shape[0] if tensors else 0)):
                    return ReadReply(msg.seq, "block ids out of range"), []
                if msg.payload:
                    frames += [as_bytes(t.index_select(0, index.to(t.device))) for t in tensors]
                else:  # the reader moves them itself (NIXL)
                    nbytes += len(index) * sum(t[0].numel() * t.element_size() for t in tensors)
            entry = self.progress.setdefault(msg.transfer_id, [t0, 0, 0])
            entry[1] += len(unpack_ids(msg.blocks[0])) if msg.blocks else 0
            entry[2] += nbytes + sum(f.nbytes for f in frames)
        return ReadReply(msg.seq), frames
