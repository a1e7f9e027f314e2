"""Disk tier for the prefix cache (a KV connector): full-attention blocks persist in files
named by their chained digest (engine/kvcache/disk_files.py), so they outlive the server and
any server of the same model that shares the directory finds them.

Writes: a block that enters the prefix cache is saved at once, not when it is evicted: the
worker half copies it to host memory after the forward that computes it (or before the forward,
for a block evicted in the same plan, which that forward may overwrite) and a writer thread
puts it on disk. A crash loses only what was being written. Beyond --kv-disk-gb the least
recently used blocks are deleted, counting the bytes their files take on disk (every rank's,
a proposer's rows and the headers included; a snapshot by its blocks); a block trimmed in the
plan that saves it is never written.

Hybrid models: a sliding-window snapshot the prefix cache keeps (engine/kvcache/kv_manager.py)
is saved as one more file, named after the block it ends; a hit from disk resumes its sliding
layers from the deepest one within the replay budget, as a hit in memory does.

Reads: a prefix hit that continues on disk allocates device blocks for the rest and the
request waits (LOADING) while the worker half reads them off the step loop; others run
meanwhile. When every rank has reported, it computes on from its hit; a read that failed (a
damaged or vanished file) frees its blocks and the request is looked up again, without them.

The index is what this server knows to be on disk: the files found at start, the blocks it
saved, and blocks other servers wrote, learnt when a lookup misses (one stat of the next
block's file).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from deepinfer.engine.kv_disk_files import HEADER_BYTES, block_path, rank_dir, scan
from deepinfer.engine.kvcache.block_hash import BlockDigests, chain, snapshot_digest
from deepinfer.engine.kvcache.connectors.base import Arrival, KVConnector, TransferCounters
from deepinfer.engine.kvcache.kv_events import DISK, KVEventLog
from deepinfer.engine.kvcache.kv_manager import KVManager
from deepinfer.engine.kvcache.radix_cache import Snapshot
from deepinfer.engine.protocol import (
    DiskLoad,
    DiskTierWork,
    DiskWrites,
    KVTransferDone,
    SchedulerStats,
    WindowSave,
    pack_ids,
)
from deepinfer.engine.request import Request, Status


@dataclass(frozen=True)
class DiskTierSettings:
    root: str  # --kv-disk-path
    identity: bytes  # the server's block identity key (engine/kv_identity.py)
    budget: int  # bytes --kv-disk-gb holds
    block_bytes: int  # one block's payload over every rank (a proposer's rows included)
    ranks: int = 1
    window_block_bytes: int = 0  # one sliding-window block's payload in a snapshot, every rank

    def file_bytes(self, payload: int) -> int:
        """What a block (or snapshot) of `payload` bytes over every rank takes on disk."""
        return payload + HEADER_BYTES * self.ranks


@dataclass
class _Loading:
    req: Request
    digests: list[bytes]
    window: bytes | None = None  # the snapshot's name, when one is read too
    reports: dict[int, KVTransferDone] = field(default_factory=dict)
    aborted: bool = False


@dataclass
class DiskCounters:
    hit_tokens: int = 0
    corrupt: int = 0
    reads: TransferCounters = field(default_factory=TransferCounters)  # one per request's load
    writes: TransferCounters = field(default_factory=TransferCounters)  # one per block written


class DiskTier(KVConnector):
    name = "disk_tier"

    def __init__(self, kv: KVManager, settings: DiskTierSettings) -> None:
        self.kv = kv
        self.settings = settings
        self.block_size = kv.block_size
        self.digests = BlockDigests(settings.identity, kv.block_size)
        # Where rank 0's files are: what lookups check (every rank writes its own share).
        self.folder: Path = rank_dir(settings.root, settings.identity, 0)
        # Digest -> its bytes on disk (every rank's files), LRU order: oldest first.
        self.index: OrderedDict[bytes, int] = OrderedDict(
            (d, size * settings.ranks) for d, _, size in sorted(scan(self.folder),
                                                               key=lambda e: e[1]))
        self.used = sum(self.index.values())
        self.full_bytes = settings.file_bytes(settings.block_bytes)
        self._pinned: set[bytes] = set()  # being loaded: not deleted meanwhile
        # Blocks whose read failed: never learnt again from a file (one that could not be
        # deleted would fail every retry), only saved anew.
        self._failed: set[bytes] = set()
        self._saves: list[tuple[int, bytes]] = []  # (device block, digest), after the forward
        self._saves_now: list[tuple[int, bytes]] = []  # before it: evicted in this plan
        self._deletes: list[bytes] = []
        self._found: list[bytes] = []  # match()'s handles, while a plan is being built
        # The prompt being admitted and its digests chained so far: match() and match_snapshot()
        # of one admission share them; loads_wait() ends the admission.
        self._admission: tuple[object, list[bytes]] | None = None
        self._planned: list[tuple[bytes, int]] = []  # (digest, device block) since loads_wait
        self._planned_window: tuple[bytes, list[int]] | None = None  # (name, sliding blocks)
        self._window_saves: list[tuple[bytes, Snapshot]] = []
        self._loads: list[DiskLoad] = []
        self._loading: dict[str, _Loading] = {}
        self.counters = DiskCounters()
        self.events: KVEventLog | None = None
        # Blocks announced as stored on DISK (KV events): only those are ever withdrawn. One
        # found on disk (at start, or written by another server) is announced when a lookup
        # meets it, where its tokens and parent are known.
        self._announced: set[bytes] = set()
        self._trim()

    def report_events(self, log: KVEventLog) -> None:
        self.events = log

    # ------------------------------------------------------------------ writes

    def on_stored(self, parent_block: int | None, tokens, blocks: list[int]) -> None:
        named = self.digests.stored(parent_block, tokens, blocks)
        if named is None:
            return
        parent, digests = named
        bs = self.block_size
        for i, (block, digest) in enumerate(zip(blocks, digests)):
            if digest in self.index:
                self.index.move_to_end(digest)
            else:
                self._add(digest, self.full_bytes)
                self._failed.discard(digest)
                self._saves.append((block, digest))
            self._announce(digest, digests[i - 1] if i else parent, tokens[i * bs:(i + 1) * bs])
        self._trim()

    def _add(self, name: bytes, size: int) -> None:
        self.index[name] = size
        self.used += size

    def _forget(self, name: bytes) -> bool:
        """Drop a block from the index (and withdraw its announcement); whether it was in."""
        size = self.index.pop(name, None)
        if size is None:
            return False
        self.used -= size
        if name in self._announced and self.events is not None:
            self._announced.discard(name)
            self.events.tier_removed(DISK, name)
        return True

    def _announce(self, digest: bytes, parent: bytes | None, tokens) -> None:
        if self.events is not None and digest not in self._announced:
            self._announced.add(digest)
            self.events.tier_stored(DISK, digest, parent, tokens)

    def on_evict(self, tokens, device_block: int) -> None:
        self.digests.removed(device_block)
        # A save still to be planned must copy the block before this plan's forward reuses it.
        keep = []
        for save in self._saves:
            (self._saves_now if save[0] == device_block else keep).append(save)
        self._saves = keep

    def on_snapshot(self, full_block: int, snapshot: Snapshot) -> None:
        entry = self.digests.get(full_block)
        if entry is None:
            return
        name = snapshot_digest(entry[0])
        if name in self.index:
            self.index.move_to_end(name)
            return
        self._add(name, self.settings.file_bytes(
            self.settings.window_block_bytes * len(snapshot.blocks)))
        self._failed.discard(name)
        self._window_saves.append((name, snapshot))
        self._trim()

    def on_snapshot_drop(self, snapshot: Snapshot) -> None:
        """A snapshot dropped before its save went out is not saved (its blocks may be reused
        by the plan being built); it was never on disk."""
        for name, snap in self._window_saves:
            if snap is snapshot:
                self._forget(name)
        self._window_saves = [(n, s) for n, s in self._window_saves if s is not snapshot]

    def _trim(self) -> None:
        """Delete least recently used blocks beyond the budget (never one being loaded). One
        whose save is still to be planned is not saved instead: deleted before the forward
        and written after it, it would stay on disk unindexed."""
        if self.used <= self.settings.budget:
            return
        for digest in list(self.index):
            if self.used <= self.settings.budget:
                break
            if digest in self._pinned:
                continue
            self._forget(digest)
            if not self._unsave(digest):
                self._deletes.append(digest)

    def _unsave(self, name: bytes) -> bool:
        """Take `name` out of the saves still to be planned (whether it was among them)."""
        for saves in (self._saves, self._saves_now, self._window_saves):
            for i, save in enumerate(saves):
                if save[0 if saves is self._window_saves else 1] == name:
                    del saves[i]
                    return True
        return False

    # ------------------------------------------------------------------ reads

    def match(self, tokens, start: int, end: int) -> list[int]:
        bs = self.block_size
        if end // bs <= start // bs:
            return []
        digests = self._prompt_digests(tokens, end // bs)
        found = []
        for j in range(start // bs, len(digests)):
            digest = digests[j]
            if not self._on_disk(digest):
                break
            self._announce(digest, digests[j - 1] if j else None, tokens[j * bs:(j + 1) * bs])
            found.append(self._pin(digest))
        return found

    def plan_load(self, handle: int, device_block: int) -> None:
        self._planned.append((self._found[handle], device_block))

    def match_snapshot(self, tokens, hit: int, start: int) -> tuple[int, int] | None:
        bs = self.block_size
        if hit < bs:
            return None
        digests = self._prompt_digests(tokens, hit // bs)
        for pos in range(hit, max(start, bs) - 1, -bs):  # the deepest first
            name = snapshot_digest(digests[pos // bs - 1])
            if self._on_disk(name):
                return pos, self._pin(name)
        return None

    def _prompt_digests(self, tokens, blocks: int) -> list[bytes]:
        """The digests of the first `blocks` blocks of the prompt being admitted, each chained
        once in the admission (match(), then match_snapshot(), get the same `tokens`)."""
        if self._admission is None or self._admission[0] is not tokens:
            self._admission = (tokens, [])
        digests = self._admission[1]
        if len(digests) < blocks:
            bs = self.block_size
            digests += chain(tokens[len(digests) * bs: blocks * bs], bs, self.settings.identity,
                             digests[-1] if digests else None)
        return digests[:blocks]

    def _on_disk(self, name: bytes) -> bool:
        """Whether the block (or snapshot) is on disk, as far as this server knows; a file
        another server wrote is learnt here, on a lookup that misses the index."""
        if name in self.index:
            self.index.move_to_end(name)
            return True
        if name in self._failed:
            return False
        try:
            size = block_path(self.folder, name).stat().st_size
        except OSError:
            return False
        self._add(name, size * self.settings.ranks)
        self._trim()
        return name in self.index

    def _pin(self, name: bytes) -> int:
        """A handle for the plan being built; not deleted until its load reports."""
        self._pinned.add(name)
        self._found.append(name)
        return len(self._found) - 1

    def plan_snapshot_load(self, handle: int, sliding_blocks: list[int]) -> None:
        self._planned_window = (self._found[handle], list(sliding_blocks))

    def loads_wait(self, req: Request) -> bool:
        self._admission = None  # the admission's lookups are over
        planned, self._planned = self._planned, []
        window, self._planned_window = self._planned_window, None
        if not planned and window is None:
            return False
        digests = [d for d, _ in planned]
        self._loading[req.request_id] = _Loading(req, digests,
                                                 window[0] if window is not None else None)
        load = DiskLoad(req.request_id, pack_ids([b for _, b in planned]), b"".join(digests))
        if window is not None:
            load.window_digest, load.window_blocks = window[0], pack_ids(window[1])
        self._loads.append(load)
        return True

    def report(self, msg) -> Arrival | None:
        if isinstance(msg, DiskWrites):
            self._wrote(msg)
            return None
        loading = self._loading.get(msg.transfer_id)
        if loading is None:
            return None
        loading.reports[msg.rank] = msg
        if len(loading.reports) < self.settings.ranks:
            return None
        del self._loading[msg.transfer_id]
        self._pinned.difference_update(loading.digests)
        self._pinned.discard(loading.window)
        reports = loading.reports.values()
        c = self.counters
        c.reads.record(loading.reports)
        c.corrupt += sum(r.damaged for r in reports)
        good = min(r.blocks for r in reports)
        failed = any(r.error is not None for r in reports)
        if failed:  # the first that failed, damaged or gone: recompute it
            bad = loading.digests[good] if good < len(loading.digests) else loading.window
            if bad is not None:
                self._forget(bad)
                self._failed.add(bad)
        if loading.aborted:
            self.kv.release(loading.req)
            return None
        if failed:
            self.kv.unmatch_prefix(loading.req)
            return Arrival(loading.req, retry=True)
        c.hit_tokens += len(loading.digests) * self.block_size
        return Arrival(loading.req, resume=True)

    def _wrote(self, msg: DiskWrites) -> None:
        writes = self.counters.writes
        writes.bytes += msg.nbytes
        for seconds in msg.seconds:
            writes.observe(seconds)
        for i in range(0, len(msg.failed), 32):  # not on disk after all (a full disk)
            self._forget(msg.failed[i:i + 32])

    def finished(self, req: Request, status: Status, logprobs) -> tuple[bool, None]:
        """A request aborted while it loads keeps its blocks until the loads report (the
        worker writes into them meanwhile)."""
        loading = self._loading.get(req.request_id)
        if status != Status.LOADING or loading is None:
            return False, None
        loading.aborted = True
        return True, None

    # ------------------------------------------------------------------ every step

    def has_plan(self) -> bool:
        return bool(self._saves or self._saves_now or self._loads or self._deletes
                    or self._window_saves)

    def plan_entry(self) -> DiskTierWork | None:
        # What lookups matched but no load took (no room) is free to go again.
        self._found = []
        self._pinned = {name for loading in self._loading.values()
                        for name in (*loading.digests, loading.window) if name is not None}
        if not self.has_plan():
            return None
        entry = DiskTierWork(
            saves=pack_ids([b for b, _ in self._saves]),
            save_digests=b"".join(d for _, d in self._saves),
            saves_now=pack_ids([b for b, _ in self._saves_now]),
            save_now_digests=b"".join(d for _, d in self._saves_now),
            loads=self._loads, deletes=b"".join(self._deletes),
            window_saves=[WindowSave(name, pack_ids(snap.blocks))
                          for name, snap in self._window_saves])
        self._saves, self._saves_now, self._loads, self._deletes = [], [], [], []
        self._window_saves = []
        return entry

    def fill_stats(self, stats: SchedulerStats) -> None:
        c = self.counters
        stats.disk_blocks_used = len(self.index)
        stats.disk_used_bytes = self.used
        stats.disk_hit_tokens = c.hit_tokens
        stats.disk_corrupt_blocks = c.corrupt
        stats.disk_bytes_read = c.reads.bytes
        stats.disk_bytes_written = c.writes.bytes
        stats.disk_read_seconds = c.reads.seconds
        stats.disk_read_buckets = list(c.reads.buckets)
        stats.disk_write_seconds = c.writes.seconds
        stats.disk_write_buckets = list(c.writes.buckets)
