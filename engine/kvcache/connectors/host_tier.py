"""Host-memory tier for the prefix cache (a KV connector): evicted blocks move to a bounded pool,
not the bin.

When the radix cache evicts a full-attention block, its contents are copied (saved) into a
host block, indexed by a digest of every token from the start through that block. A later
request whose prefix continues past the radix hit looks the next blocks up here and copies them
back (loads them) instead of recomputing them. The copies are listed in the next StepPlan and
the workers run them before the forward pass (workers/kv_connectors/host_tier.py): every
connector's saves first, then loads, so a device block evicted and reused in the same step (by
this tier or another) is saved before it is overwritten.

Invariant: while a plan is being built, a host block it reads (a load's source, pinned from the
moment match() finds it) or writes (a save's target) is never handed out again, so one plan
never writes a host block twice (the workers' indexed copy would keep either write) nor
overwrites one it still has to read.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from deepinfer.engine.kvcache.block_hash import token_bytes
from deepinfer.engine.kvcache.connectors.base import KVConnector
from deepinfer.engine.kvcache.kv_events import HOST, KVEventLog
from deepinfer.engine.protocol import HostTierCopies, SchedulerStats, pack_ids


def prefix_digest(tokens) -> bytes:
    """Exact identity of a block-aligned prefix (collisions are not a practical concern); a
    LoRA adapter's prefix is its own (its ids are salted)."""
    return hashlib.blake2b(token_bytes(tokens), digest_size=16).digest()


class HostTier(KVConnector):
    name = "host_tier"

    def __init__(self, num_blocks: int, block_size: int, block_bytes: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.block_bytes = block_bytes  # one block's bytes (over every rank)
        self._free = list(range(num_blocks))
        self._index: OrderedDict[bytes, int] = OrderedDict()  # LRU order: oldest first
        self._pinned: set[int] = set()  # host blocks the plan being built reads or writes
        self.saves: list[tuple[int, int]] = []  # (device block, host block) for the next plan
        self.loads: list[tuple[int, int]] = []  # (host block, device block)
        self.blocks_saved = 0
        self.blocks_loaded = 0
        # KV events (--kv-events-config): a block copied here is stored on the host medium,
        # one this tier lets go of is removed from it; keyed like _index, by prefix digest.
        self.events: KVEventLog | None = None
        self._chained: dict[bytes, bytes] = {}

    @property
    def num_used(self) -> int:
        return len(self._index)

    def report_events(self, log: KVEventLog) -> None:
        self.events = log

    def on_evict(self, tokens, device_block: int) -> None:
        """Keep an evicted block: called by the radix cache before it frees device_block."""
        key = prefix_digest(tokens)
        if key in self._index:
            self._index.move_to_end(key)
            return
        host = self._take()
        if host is None:
            return
        self._index[key] = host
        self._pinned.add(host)
        self.saves.append((device_block, host))
        self.blocks_saved += 1
        entry = self.events.digest(device_block) if self.events is not None else None
        if entry is not None:
            self._chained[key] = entry[0]
            self.events.tier_stored(HOST, entry[0], entry[1], tokens[-self.block_size:])

    def _take(self) -> int | None:
        if self._free:
            return self._free.pop()
        for key, host in self._index.items():  # least recently used first
            if host not in self._pinned:
                del self._index[key]
                digest = self._chained.pop(key, None)
                if digest is not None:
                    self.events.tier_removed(HOST, digest)
                return host
        return None

    def match(self, tokens, start: int, end: int) -> list[int]:
        """Host blocks holding the block-aligned prefixes of tokens[:start + k*bs] <= end.

        They are pinned for the plan being built: evictions that follow (to make device room
        for the load) must not recycle them.
        """
        found = []
        bs = self.block_size
        pos = start + bs
        while pos <= end:
            key = prefix_digest(tokens[:pos])
            host = self._index.get(key)
            if host is None:
                break
            self._index.move_to_end(key)
            self._pinned.add(host)
            found.append(host)
            pos += bs
        return found

    def plan_load(self, host_block: int, device_block: int) -> None:
        self._pinned.add(host_block)
        self.loads.append((host_block, device_block))

    def cancel_loads(self, device_blocks: list[int]) -> None:
        drop = set(device_blocks)
        self.loads = [(h, d) for h, d in self.loads if d not in drop]

    def plan_entry(self) -> HostTierCopies | None:
        """The copies for the plan being sent; pins end with it. Loads count as hits only here:
        one planned for a request that then had to wait was cancelled."""
        saves, loads = self.saves, self.loads
        self.blocks_loaded += len(loads)
        self.saves, self.loads = [], []
        self._pinned.clear()
        if not (saves or loads):
            return None
        return HostTierCopies(pack_ids(saves) if saves else b"", pack_ids(loads) if loads else b"")

    def fill_stats(self, stats: SchedulerStats) -> None:
        stats.host_blocks_used = self.num_used
        stats.host_blocks_out = self.blocks_saved
        stats.host_blocks_in = self.blocks_loaded
        stats.host_hit_tokens = self.blocks_loaded * self.block_size
        stats.host_block_bytes = self.block_bytes
