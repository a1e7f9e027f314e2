"""Host-memory tier for the prefix cache (a KV connector): evicted blocks move to a bounded pool,
not the bin.

When the radix cache evicts a full-attention block, its contents are copied (swap-out) into a
host block, indexed by a digest of every token from the start through that block. A later
request whose prefix continues past the radix hit looks the next blocks up here and copies them
back (swap-in) instead of recomputing them. The copies are listed in the next StepPlan and the
workers run them before the forward pass: swap-outs first, then swap-ins, so a device block
evicted and reused in the same step is saved before it is overwritten.

Invariant: while a plan is being built, a host block it reads (a swap-in source, pinned from the
moment match() finds it) or writes (a swap-out target) is never handed out again, so one plan
never writes a host block twice (the workers' indexed copy would keep either write) nor
overwrites one it still has to read.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from engine.kvcache.connector import KVConnector


def prefix_digest(tokens) -> bytes:
    """Exact identity of a block-aligned prefix (collisions are not a practical concern)."""
    return hashlib.blake2b(np.asarray(tokens, dtype=np.int32).tobytes(), digest_size=16).digest()


class HostTier(KVConnector):
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks))
        self._index: OrderedDict[bytes, int] = OrderedDict()  # LRU order: oldest first
        self._pinned: set[int] = set()  # host blocks the plan being built reads or writes
        self.swap_out: list[tuple[int, int]] = []  # (device block, host block) for the next plan
        self.swap_in: list[tuple[int, int]] = []  # (host block, device block)
        self.blocks_out = 0
        self.blocks_in = 0

    @property
    def num_used(self) -> int:
        return len(self._index)

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
        self.swap_out.append((device_block, host))
        self.blocks_out += 1

    def _take(self) -> int | None:
        if self._free:
            return self._free.pop()
        for key, host in self._index.items():  # least recently used first
            if host not in self._pinned:
                del self._index[key]
                return host
        return None

    def match(self, tokens, start: int, end: int) -> list[int]:
        """Host blocks holding the block-aligned prefixes of tokens[:start + k*bs] <= end.

        They are pinned for the plan being built: evictions that follow (to make device room
        for the swap-in) must not recycle them.
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
        self.swap_in.append((host_block, device_block))

    def cancel_loads(self, device_blocks: list[int]) -> None:
        drop = set(device_blocks)
        self.swap_in = [(h, d) for h, d in self.swap_in if d not in drop]

    def take_plan(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies for the plan being sent; pins end with it. Swap-ins count as hits only
        here: one planned for a request that then had to wait was cancelled."""
        out, into = self.swap_out, self.swap_in
        self.blocks_in += len(into)
        self.swap_out, self.swap_in = [], []
        self._pinned.clear()
        return out, into
