"""Prefill side of a KV transfer: a thread per worker rank that serves the blocks of held
prompts to decode servers' ranks, and reports to the scheduler when a decode side is done.

Which blocks are held is the scheduler's business (engine/kvcache/transfer.py): each plan tells
the thread of new holds (`hold`: a transfer id and its blocks) and of transfers released since
(`release`, called by the step loop before a plan's forward, under the same lock as a read: once
it returns no read of them is under way, so their blocks may be overwritten). A read is served
only when its MAC says a member of the cluster sent it (engine/kv_transfer_wire.py), for a
transfer held now, and only of that transfer's own blocks. A `Release` (from the decode rank
that pulled it, or from the PD router when no decode server took it) ends a transfer here at
once: the scheduler frees its blocks when every rank has reported it.

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

from deepinfer.engine.kv_transfer_wire import (
    REQUEST_OVERHEAD,
    Meta,
    Read,
    ReadReply,
    ToSender,
    reply_mac,
    request_mac_ok,
)
from deepinfer.engine.protocol import KVHold, KVTransferDone, unpack_ids
from deepinfer.engine.runtime.ipc import push
from deepinfer.workers.kv_connectors.transfer.wire import as_bytes

log = logging.getLogger("deepinfer.kv_transfer")
_REMEMBER_RELEASED = 65536  # released transfer ids kept to refuse late reads


def max_request_bytes(tensors: list[list[torch.Tensor]]) -> int:
    """The largest frame a decode rank's request can be: a Read of every block of every KV
    group (int32 ids), with its framing."""
    blocks = max((t.shape[0] for group in tensors for t in group), default=0)
    return REQUEST_OVERHEAD + 4 * blocks * max(len(tensors), 1)


class KVSender(threading.Thread):
    def __init__(self, zctx: zmq.Context, tensors: list[list[torch.Tensor]], host: str,
                 rank: int, report_to: str, secret: bytes, backend: str = "zmq") -> None:
        super().__init__(name="deepinfer-kv-sender", daemon=True)
        self.zctx, self.tensors, self.rank = zctx, tensors, rank
        self.report_to, self.secret = report_to, secret
        self.sock = zctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # Any host that reaches the port may send: a frame larger than the largest request a
        # decode rank can make (every block id of every group) is dropped with its connection
        # as its size arrives, before it is buffered (its MAC is checked only once it is whole).
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_request_bytes(tensors))
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.nonce = uuid.uuid4().hex[:12]
        self.address = f"tcp://{host}:{port}#{self.nonce}"
        self.lock = threading.Lock()
        self.held: dict[str, list[np.ndarray]] = {}  # transfer id -> its sorted block ids
        self.released: OrderedDict[str, None] = OrderedDict()
        self.progress: dict[str, list] = {}  # transfer id -> [first read at, blocks, bytes]
        self.nixl = None
        if backend == "nixl":
            from deepinfer.workers.kv_connectors.transfer.nixl_transport import NixlSource

            self.nixl = NixlSource(tensors, f"deepinfer-prefill-{self.nonce}-{rank}")

    def hold(self, holds: list[KVHold]) -> None:
        with self.lock:
            for h in holds:
                if h.transfer_id not in self.released:  # a Release can overtake its plan
                    self.held[h.transfer_id] = [np.sort(unpack_ids(b)) for b in h.blocks]

    def release(self, transfer_ids: list[str]) -> None:
        with self.lock:
            for tid in transfer_ids:
                self.held.pop(tid, None)
                self.released[tid] = None
                self.progress.pop(tid, None)
            while len(self.released) > _REMEMBER_RELEASED:
                self.released.popitem(last=False)

    def run(self) -> None:
        report = push(self.zctx, self.report_to)
        decode = msgspec.msgpack.Decoder(ToSender).decode
        encode = msgspec.msgpack.Encoder().encode
        while True:
            ident, *frames = self.sock.recv_multipart()
            try:
                msg = decode(frames[0]) if request_mac_ok(self.secret, self.nonce, frames) else None
            except msgspec.DecodeError:
                msg = None
            if msg is None:  # a stranger, another cluster, or a sender that restarted since
                error = ReadReply(-1, "the prefill server refused an unauthenticated request "
                                      "(another --cluster-secret, or it restarted since)")
                self.sock.send_multipart([ident, encode(error), b""])
                continue
            if isinstance(msg, (Read, Meta)):
                reply, blocks = self._answer(msg)
                header = encode(reply)
                self.sock.send_multipart(
                    [ident, header, reply_mac(self.secret, self.nonce, frames[1], header),
                     *blocks], copy=False)
                continue
            with self.lock:
                first, blocks, nbytes = self.progress.pop(msg.transfer_id,
                                                          (time.perf_counter(), 0, 0))
            # Refused from now on, not from the scheduler's next plan (which may come late on
            # an idle server): a replayed pull must not be served meanwhile.
            self.release([msg.transfer_id])
            report.send(encode(KVTransferDone(
                msg.transfer_id, self.rank, blocks, nbytes, time.perf_counter() - first,
                cancelled=msg.cancelled)))

    def _answer(self, msg: Read | Meta) -> tuple[ReadReply, list]:
        if msg.nonce != self.nonce:
            return ReadReply(msg.seq, "the prefill server restarted; its KV is gone"), []
        if isinstance(msg, Meta):
            return self._meta(msg), []
        try:
            return self._read(msg)
        except Exception as exc:  # answer it: a dead thread would hang every pull
            log.exception("KV read failed")
            return ReadReply(msg.seq, f"{type(exc).__name__}: {exc}"), []

    def _meta(self, msg: Meta) -> ReadReply:
        if self.nixl is None:
            return ReadReply(msg.seq, "the prefill server moves KV over ZeroMQ "
                                      "(--kv-transfer-backend zmq), not NIXL")
        return ReadReply(msg.seq, meta=self.nixl.meta)

    def _read(self, msg: Read) -> tuple[ReadReply, list]:
        t0 = time.perf_counter()
        frames, nbytes = [], 0
        with self.lock:
            held = self.held.get(msg.transfer_id)
            if held is None:
                if msg.transfer_id in self.released:
                    return ReadReply(msg.seq, f"transfer {msg.transfer_id} was released (its "
                                              "hold timed out, or it was pulled already)"), []
                return ReadReply(msg.seq, f"transfer {msg.transfer_id} is not held here",
                                 retry=True), []
            if msg.blocks and len(msg.blocks) != len(held):
                return ReadReply(msg.seq, f"{len(msg.blocks)} KV groups asked for, the "
                                          f"transfer has {len(held)}"), []
            for tensors, ids, own in zip(self.tensors, msg.blocks, held):
                wanted = unpack_ids(ids)
                if not np.isin(wanted, own, assume_unique=False).all():
                    return ReadReply(msg.seq, "block ids that are not the transfer's own"), []
                index = torch.from_numpy(wanted.astype(np.int64))
                if msg.payload:
                    frames += [as_bytes(t.index_select(0, index.to(t.device))) for t in tensors]
                else:  # the reader moves them itself (NIXL)
                    nbytes += len(index) * sum(t[0].numel() * t.element_size() for t in tensors)
            entry = self.progress.setdefault(msg.transfer_id, [t0, 0, 0])
            entry[1] += len(unpack_ids(msg.blocks[0])) if msg.blocks else 0
            entry[2] += nbytes + sum(f.nbytes for f in frames)
        return ReadReply(msg.seq), frames
