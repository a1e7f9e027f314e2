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
from deepinfer.engine.kv_layout import FULL, SLIDING
from deepinfer.engine.protocol import DiskLoad, DiskTierWork, DiskWrites, KVTransferDone, unpack_ids
from deepinfer.engine.runtime.ipc import push
from deepinfer.workers.kv_cache import KVCache
from deepinfer.workers.kv_connectors.base import WorkerConnector

log = logging.getLogger("deepinfer.worker")

DIGEST = 32
_PAUSE_AFTER_FAILURE = 30.0  # seconds without writes after a write failed (a full disk)
# Failures of the disk itself (what pauses writes); others concern one block's path.
_DISK_ERRORS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EAGAIN})
READ_DEADLINE = 30.0  # seconds a block file's read may take (a hung filesystem)
_REPORT_EVERY = 64  # blocks written between two reports (and whenever the queue is empty)
MAX_PENDING_BYTES = 1 << 30  # blocks waiting for the writer, at most (then saves are dropped)


def _digests(packed: bytes) -> list[bytes]:
    return [packed[i:i + DIGEST] for i in range(0, len(packed), DIGEST)]


class DiskTierWorker(WorkerConnector):
    name = "disk_tier"

    def __init__(self, holders: Sequence[KVCache], root: str, identity: bytes, rank: int,
                 zctx: zmq.Context, report_to: str) -> None:
        """`holders`: the target's cache first, then any proposer's."""
        self.full = _Rows([t for cache in holders for pair in cache.of_kind(FULL) for t in pair])
        # Sliding-window snapshots: the sliding entries' rows of their blocks, in one file.
        self.window = _Rows([t for cache in holders for pair in cache.of_kind(SLIDING)
                             for t in pair])
        self.block_bytes = self.full.block_bytes
        self.folder = rank_dir(root, identity, rank)
        self.key = rank_identity(identity, rank)
        self.rank = rank
        self.pending: dict[bytes, np.ndarray] = {}  # saved, not yet on disk
        self.pending_bytes = 0
        self.dropped = b""  # digests not queued (too much pending): reported as failed
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

    def save(self, entry: DiskTierWork) -> None:
        if entry.saves_now:
            self._save(entry.saves_now, entry.save_now_digests)

    def before_forward(self, entry: DiskTierWork) -> None:
        for digest in _digests(entry.deletes):
            self.writes.put(("delete", digest, None))
        for load in entry.loads:
            self.loads.put(load)

    def after_forward(self, entry: DiskTierWork) -> None:
        if entry.saves:
            self._save(entry.saves, entry.save_digests)
        for save in entry.window_saves:  # one file per snapshot: its blocks' rows in order
            self._queue(save.digest, self.window.gather(unpack_ids(save.blocks)).reshape(-1))

    def _save(self, packed: bytes, digests: bytes) -> None:
        """Gather the blocks into host memory now (the step loop may reuse them next)."""
        blocks = self.full.gather(unpack_ids(packed))
        for digest, payload in zip(_digests(digests), blocks):
            self._queue(digest, payload)

    def _queue(self, digest: bytes, payload: np.ndarray) -> None:
        with self.pending_lock:
            if digest in self.pending:  # saved again before written: one write does
                return
            if self.pending_bytes + payload.nbytes > MAX_PENDING_BYTES:
                # The disk cannot keep up: drop the save (the scheduler hears it failed)
                # rather than hold ever more blocks in memory.
                self.dropped += digest
                return
            self.pending[digest] = payload
            self.pending_bytes += payload.nbytes
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
                    if e.errno not in _DISK_ERRORS:  # this block's path alone (a directory there)
                        log.warning("disk tier: cannot write a block (%s)", e)
                    elif time.monotonic() >= paused_until:
                        log.warning("disk tier: cannot write %s (%s); writes pause for %.0f s, "
                                    "serving goes on", self.folder, e.strerror or e,
                                    _PAUSE_AFTER_FAILURE)
                        paused_until = time.monotonic() + _PAUSE_AFTER_FAILURE
                    done.failed += digest
                except Exception:  # never the writer thread: saves would pile up in memory
                    log.exception("disk tier: cannot write a block")
                    done.failed += digest
                finally:
                    with self.pending_lock:
                        gone = self.pending.pop(digest, None)
                        self.pending_bytes -= 0 if gone is None else gone.nbytes
                        done.failed += self.dropped
                        self.dropped = b""
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
        on_gpu = any(t.is_cuda for t in self.full.tensors)
        stream = torch.cuda.Stream(self.full.tensors[0].device) if on_gpu else None
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

    def _read(self, digest: bytes, size: int) -> tuple[np.ndarray, int]:
        """A block's (or snapshot's) bytes, from the writer's queue or its file; and the bytes
        read from disk. Raises OSError or DamagedBlock (the file is deleted)."""
        with self.pending_lock:
            payload = self.pending.get(digest)
        if payload is not None:
            return payload, 0
        try:
            data = _within(READ_DEADLINE, read_block, self.folder, digest, self.key, size)
        except DamagedBlock as e:
            delete_block(self.folder, digest)
            log.warning("disk tier: deleted a damaged block file (%s)", e)
            raise
        return np.frombuffer(data, np.uint8), len(data)

    def _load(self, load: DiskLoad) -> KVTransferDone:
        t0 = time.perf_counter()
        targets = unpack_ids(load.blocks).astype(np.int64)
        window = unpack_ids(load.window_blocks).astype(np.int64)
        payloads, error, damaged, nbytes = [], None, 0, 0
        wanted = [(d, self.full.block_bytes) for d in _digests(load.digests)]
        if len(window):
            wanted.append((load.window_digest, self.window.block_bytes * len(window)))
        for digest, size in wanted:
            try:
                payload, n = self._read(digest, size)
            except FileNotFoundError:
                error = "a block's file is gone (evicted by another server?)"
            except DamagedBlock as e:
                error, damaged = f"a damaged block file: {e}", 1
            except OSError as e:
                error = f"cannot read a block file: {e.strerror or e}"
            if error is not None:
                break
            nbytes += n
            payloads.append(payload)
        full = payloads[:len(targets)]
        if full:
            self.full.scatter(np.stack(full), targets[:len(full)])
        if len(payloads) > len(targets):
            self.window.scatter(payloads[-1].reshape(len(window), -1), window)
        return KVTransferDone(load.request_id, self.rank, blocks=len(full), bytes=nbytes,
                              seconds=time.perf_counter() - t0, error=error, damaged=damaged)


def _within(seconds: float, read, *args):
    """`read(*args)` on a thread of its own, given up after `seconds` (TimeoutError): a read
    that hangs (a filesystem gone away) holds that thread, never the loader."""
    box: list = []
    done = threading.Event()

    def run() -> None:
        try:
            box.append((True, read(*args)))
        except BaseException as e:  # handed to the loader
            box.append((False, e))
        done.set()

    threading.Thread(target=run, name="disk-read", daemon=True).start()
    if not done.wait(seconds):
        raise TimeoutError(errno.ETIMEDOUT, f"no answer in {seconds:.0f} s")
    ok, value = box[0]
    if not ok:
        raise value
    return value


class _Rows:
    """A set of KV tensors seen as one row of bytes per block: what a block's file holds."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.row_bytes = [t[0].numel() * t.element_size() for t in tensors]
        self.block_bytes = sum(self.row_bytes)

    def gather(self, blocks: np.ndarray) -> np.ndarray:
        """[n, block_bytes] uint8 on the host: the blocks' rows, tensor after tensor."""
        index = torch.from_numpy(blocks.astype(np.int64))
        rows = [t.index_select(0, index.to(t.device)).reshape(len(index), -1)
                .view(torch.uint8).cpu() for t in self.tensors]
        return torch.cat(rows, dim=1).numpy() if rows else np.zeros((len(index), 0), np.uint8)

    def scatter(self, blocks: np.ndarray, targets: np.ndarray) -> None:
        """The inverse: [n, block_bytes] uint8 into each tensor's rows at `targets`."""
        if not blocks.flags.writeable or not blocks.flags.c_contiguous:  # (torch wants both)
            blocks = np.array(blocks)
        host = torch.from_numpy(blocks)
        index = torch.from_numpy(targets)
        offset = 0
        for t, size in zip(self.tensors, self.row_bytes):
            part = host[:, offset:offset + size].contiguous().view(t.dtype)
            offset += size
            t.index_copy_(0, index.to(t.device), part.view(len(targets), *t.shape[1:]).to(
                t.device, non_blocking=True))

