"""The disk tier, worker half: this rank's share of each block goes to and comes from its own
files (engine/kvcache/disk_files.py), off the step loop.

Saves: the plan's device blocks are gathered into host memory on the step loop (after the
forward that computes them, or before it for blocks that forward may overwrite), then a writer
thread writes them; until a block is on disk the loader reads it from the writer's queue.
Loads: a loader thread reads a request's files, checks them, copies them into the device blocks
the scheduler allocated (nothing else touches those until the report) and reports to the
scheduler. A damaged file is deleted and reported; the blocks before it were good.

A full disk (or any failing write) stops writing for a while with a warning, and the blocks
not written are reported so the scheduler forgets them; serving goes on.
"""

from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from collections.abc import Sequence
from contextlib import nullcontext

import msgspec
import numpy as np
import torch
import zmq

from deepinfer.engine.kv_disk_files import (
    DamagedBlock,
    delete_block,
    rank_dir,
    read_block,
    write_block,
)
from deepinfer.engine.kv_identity import rank_identity
from deepinfer.engine.protocol import DiskLoad, DiskTierWork, DiskWrites, KVTransferDone, unpack_ids
from deepinfer.engine.runtime.ipc import push
from deepinfer.workers.kv_cache import KVCache
from deepinfer.workers.kv_connectors.base import WorkerConnector

log = logging.getLogger("deepinfer.worker")

DIGEST = 32
_PAUSE_AFTER_FAILURE = 30.0  # seconds without writes after a write failed (a full disk)
_REPORT_EVERY = 64  # blocks written between two reports (and whenever the queue is empty)


def _digests(packed: bytes) -> list[bytes]:
    return [packed[i:i + DIGEST] for i in range(0, len(packed), DIGEST)]


class DiskTierWorker(WorkerConnector):
    name = "disk_tier"

    def __init__(self, holders: Sequence[KVCache], root: str, identity: bytes, rank: int,
                 zctx: zmq.Context, report_to: str) -> None:
        """`holders`: the target's cache first, then any proposer's."""
        self.tensors = [t for cache in holders for pair in cache.full_attention() for t in pair]
        self.row_bytes = [t[0].numel() * t.element_size() for t in self.tensors]
        self.block_bytes = sum(self.row_bytes)
        self.folder = rank_dir(root, identity, rank)
        self.key = rank_identity(identity, rank)
        self.rank = rank
        self.pending: dict[bytes, np.ndarray] = {}  # saved, not yet on disk
        self.pending_lock = threading.Lock()
        self.close_lock = threading.Lock()
        self.writes: queue.Queue = queue.Queue()
        self.loads: queue.Queue = queue.Queue()
        self.writer = threading.Thread(target=self._write_loop, args=(zctx, report_to),
                                       name=f"disk-writer-{rank}", daemon=True)
        self.loader = threading.Thread(target=self._load_loop, args=(zctx, report_to),
                                       name=f"disk-loader-{rank}", daemon=True)
        self.writer.start()
        self.loader.start()

    # ------------------------------------------------------------------ the step loop

    def before_forward(self, entry: DiskTierWork) -> None:
        if entry.saves_now:
            self._save(entry.saves_now, entry.save_now_digests)
        for digest in _digests(entry.deletes):
            self.writes.put(("delete", digest, None))
        for load in entry.loads:
            self.loads.put(load)

    def after_forward(self, entry: DiskTierWork) -> None:
        if entry.saves:
            self._save(entry.saves, entry.save_digests)

    def _save(self, packed: bytes, digests: bytes) -> None:
        """Gather the blocks into host memory now (the step loop may reuse them next)."""
        index = torch.from_numpy(unpack_ids(packed).astype(np.int64))
        rows = [t.index_select(0, index.to(t.device)).reshape(len(index), -1).view(torch.uint8)
                .cpu() for t in self.tensors]
        blocks = torch.cat(rows, dim=1).numpy() if rows else np.zeros((len(index), 0), np.uint8)
        with self.pending_lock:
            for digest, payload in zip(_digests(digests), blocks):
                self.pending[digest] = payload
        for digest in _digests(digests):
            self.writes.put(("save", digest, None))

    def close(self) -> None:
        """Flush the writes still queued (a drain before shutdown), then stop (the step loop
        and a stopping timer may both call it)."""
        with self.close_lock:
            if self.writer.is_alive():
                self.writes.put(("stop", b"", None))
                self.loads.put(None)
                self.writer.join()

    # ------------------------------------------------------------------ the writer

    def _write_loop(self, zctx: zmq.Context, report_to: str) -> None:
        report = push(zctx, report_to)
        encode = msgspec.msgpack.Encoder().encode
        done = DiskWrites(self.rank)
        paused_until = 0.0
        while True:
            kind, digest, _ = self.writes.get()
            if kind == "stop":
                break
            if kind == "delete":
                delete_block(self.folder, digest)
            else:
                with self.pending_lock:
                    payload = self.pending.get(digest)
                t0 = time.perf_counter()
                try:
                    if time.monotonic() < paused_until:
                        raise OSError(errno.EAGAIN, "writes paused after a failure")
                    done.nbytes += write_block(self.folder, digest, self.key, payload)
                    done.blocks += 1
                    done.seconds.append(time.perf_counter() - t0)
                except OSError as e:
                    if time.monotonic() >= paused_until:
                        log.warning("disk tier: cannot write %s (%s); writes pause for %.0f s, "
                                    "serving goes on", self.folder, e.strerror or e,
                                    _PAUSE_AFTER_FAILURE)
                        paused_until = time.monotonic() + _PAUSE_AFTER_FAILURE
                    done.failed += digest
                finally:
                    with self.pending_lock:
                        self.pending.pop(digest, None)
            if done.blocks + len(done.failed) // DIGEST >= _REPORT_EVERY or self.writes.empty():
                if done.blocks or done.failed:
                    report.send(encode(done))
                done = DiskWrites(self.rank)
        if done.blocks or done.failed:
            report.send(encode(done))
        report.close(linger=1000)

    # ------------------------------------------------------------------ the loader

    def _load_loop(self, zctx: zmq.Context, report_to: str) -> None:
        report = push(zctx, report_to)
        encode = msgspec.msgpack.Encoder().encode
        on_gpu = any(t.is_cuda for t in self.tensors)
        stream = torch.cuda.Stream(self.tensors[0].device) if on_gpu else None
        while True:
            load = self.loads.get()
            if load is None:
                break
            with torch.inference_mode(), torch.cuda.stream(stream) if on_gpu else nullcontext():
                done = self._load(load)
                if on_gpu:  # the copies must have landed before the scheduler hears of them
                    stream.synchronize()
            report.send(encode(done))
        report.close(linger=1000)

    def _load(self, load: DiskLoad) -> KVTransferDone:
        t0 = time.perf_counter()
        digests = _digests(load.digests)
        targets = unpack_ids(load.blocks).astype(np.int64)
        payloads, error, damaged, nbytes = [], None, 0, 0
        for digest in digests:
            with self.pending_lock:
                payload = self.pending.get(digest)
            if payload is None:
                try:
                    payload = np.frombuffer(read_block(self.folder, digest, self.key,
                                                       self.block_bytes), np.uint8)
                except FileNotFoundError:
                    error = "a block's file is gone (evicted by another server?)"
                except DamagedBlock as e:
                    error, damaged = f"a damaged block file: {e}", 1
                    delete_block(self.folder, digest)
                    log.warning("disk tier: deleted a damaged block file (%s)", e)
                except OSError as e:
                    error = f"cannot read a block file: {e.strerror or e}"
                if error is not None:
                    break
                nbytes += len(payload)
            payloads.append(payload)
        if payloads:
            self._copy_in(np.stack(payloads), targets[:len(payloads)])
        return KVTransferDone(load.request_id, self.rank, blocks=len(payloads), bytes=nbytes,
                              seconds=time.perf_counter() - t0, error=error, damaged=damaged)

    def _copy_in(self, blocks: np.ndarray, targets: np.ndarray) -> None:
        """blocks [n, block_bytes] uint8 -> each tensor's rows at `targets`."""
        host = torch.from_numpy(blocks)
        offset = 0
        for t, size in zip(self.tensors, self.row_bytes):
            part = host[:, offset:offset + size].contiguous().view(t.dtype)
            offset += size
            index = torch.from_numpy(targets).to(t.device)
            t.index_copy_(0, index, part.view(len(targets), *t.shape[1:]).to(
                t.device, non_blocking=True))

