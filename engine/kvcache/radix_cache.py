"""Prefix cache: a radix tree over token ids at block granularity, with LRU eviction.

Only full blocks are cached. The tree holds one allocator reference on each cached block. A request
that reuses a prefix calls match() then lock() at once: lock takes the request's own reference on
each matched block (freed with allocator.free like its other blocks) and pins the path; unlock()
unpins it. Eviction removes least-recently-used unlocked leaves whose blocks only the tree holds,
tail block first, so whatever stays is still a valid prefix.

A node may also hold a sliding-window snapshot for the position where it ends: the blocks of the
sliding-window layers (another allocator's) that a query at that position can still see. A hit
there needs no replay for those layers. A snapshot lives and dies with its position: when the
node's tail block is evicted the snapshot goes too, and under pressure on the sliding blocks the
least recently used snapshots are dropped on their own (`evict_snapshots`).
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from deepinfer.engine.kvcache.block_allocator import BlockAllocator
from deepinfer.engine.kvcache.kv_events import KVEventLog

BlockKey = tuple[int, ...]  # the token ids of one full block
Tokens = np.ndarray | Sequence[int]
# Called before an evicted block is freed: (all tokens from the start through that block, block id).
EvictCallback = Callable[[BlockKey, int], None]
# Called when blocks enter the cache: (the cached block before them or None, their tokens, ids).
InsertCallback = Callable[[int | None, list[int], list[int]], None]


@dataclass
class Snapshot:
    """Sliding-window blocks at a node's end: table index `first` onwards, in order."""

    first: int
    blocks: list[int]


class RadixNode:
    """A run of full blocks; children are keyed by the token ids of their first block."""

    __slots__ = ("keys", "blocks", "children", "parent", "last_access", "lock", "snapshot")

    def __init__(
        self, keys: list[BlockKey], blocks: list[int], parent: RadixNode | None, last_access: int,
    ) -> None:
        self.keys = keys
        self.blocks = blocks
        self.children: dict[BlockKey, RadixNode] = {}
        self.parent = parent
        self.last_access = last_access  # logical clock, not wall time
        self.lock = 0  # live requests whose matched path runs through this node
        self.snapshot: Snapshot | None = None  # sliding-window KV at this node's end


@dataclass(frozen=True)
class PrefixMatch:
    blocks: list[int]
    num_tokens: int  # len(blocks) * block_size
    node: RadixNode  # deepest matched node: the handle for unlock()
    query_tokens: int = 0  # tokens asked for, counted into queries_tokens on lock()


class RadixCache:
    def __init__(
        self, allocator: BlockAllocator, block_size: int, on_evict: EvictCallback | None = None,
        snapshot_allocator: BlockAllocator | None = None,
    ) -> None:
        if block_size != allocator.block_size:
            raise ValueError("the cache and the allocator must use the same block size")
        self.allocator = allocator
        self.snapshot_allocator = snapshot_allocator  # the sliding layers' blocks, if any
        self.block_size = block_size
        self.on_evict = on_evict  # hook for a host-memory tier
        self.on_insert: InsertCallback | None = None  # hook for a disk tier
        # Hooks for a disk tier: a snapshot kept at the end of a cached block (the tree's block
        # there, the snapshot), and one dropped.
        self.on_snapshot: Callable[[int, Snapshot], None] | None = None
        self.on_snapshot_drop: Callable[[Snapshot], None] | None = None
        self.events: KVEventLog | None = None  # KV events (--kv-events-config): what enters/leaves
        self._root = RadixNode([], [], None, 0)
        self._clock = 0
        self.num_cached_blocks = 0
        self.hits_tokens = 0
        self.queries_tokens = 0
        self.evictions = 0  # blocks evicted (reset() not counted)
        self.num_snapshots = 0

    # ------------------------------------------------------------------ lookup

    def match(self, tokens: Tokens, max_tokens: int | None = None) -> PrefixMatch:
        """Longest cached prefix of full blocks within the first max_tokens tokens.

        Takes no references: call lock() before anything can evict (the scheduler passes
        max_tokens=len(prompt)-1 so at least one prompt token is computed).
        """
        n = len(tokens) if max_tokens is None else max(0, min(len(tokens), max_tokens))
        node, i, blocks = self._walk(self._keys(tokens, n))
        return PrefixMatch(blocks, i * self.block_size, node, len(tokens))

    def lock(self, match: PrefixMatch) -> None:
        """Give the request one reference per matched block and pin the path against eviction."""
        for b in match.blocks:
            self.allocator.share(b)
        node: RadixNode | None = match.node
        while node is not None:
            node.lock += 1
            node = node.parent
        # Counted here, not in match(), so a request retried at the queue head counts once.
        self.hits_tokens += match.num_tokens
        self.queries_tokens += match.query_tokens

    def unlock(self, node: RadixNode) -> None:
        n: RadixNode | None = node
        while n is not None:
            if n.lock <= 0:
                raise ValueError("unlock without a matching lock")
            n.lock -= 1
            n = n.parent

    # ------------------------------------------------------------------ insert

    def insert(self, tokens: Tokens, blocks: list[int]) -> int:
        """Cache a request's full blocks; returns the number of newly cached tokens.

        Blocks whose prefix is already cached keep the tree's block (the request's duplicate is
        not taken); new blocks get a tree reference of their own.
        """
        n = min(len(blocks), len(tokens) // self.block_size)
        keys = self._keys(tokens, n * self.block_size)
        node, i, path = self._walk(keys)
        if i == n:
            return 0
        new = list(blocks[i:n])
        if self.events is not None or self.on_insert is not None:
            parent, new_tokens = path[i - 1] if i else None, [t for key in keys[i:] for t in key]
            if self.events is not None:
                self.events.stored(parent, new_tokens, new)
            if self.on_insert is not None:
                self.on_insert(parent, new_tokens, new)
        for b in new:
            self.allocator.share(b)
        # Always a new child, never an extension of a leaf: a lock handle must keep covering
        # exactly the blocks it matched.
        node.children[keys[i]] = RadixNode(keys[i:], new, node, self._clock)
        self.num_cached_blocks += len(new)
        return len(new) * self.block_size

    # ------------------------------------------------------------------ snapshots

    def add_snapshot(self, tokens: Tokens, num_tokens: int, snapshot: Snapshot) -> bool:
        """Keep `snapshot` (the tree takes its own reference on each block) at the position
        `num_tokens`, whose full blocks must be cached. False if one is there already."""
        keys = self._keys(tokens, num_tokens)
        node, i, _ = self._walk(keys)
        if i != len(keys) or node is self._root or node.snapshot is not None:
            return False
        for b in snapshot.blocks:
            self.snapshot_allocator.share(b)
        node.snapshot = Snapshot(snapshot.first, list(snapshot.blocks))
        self.num_snapshots += 1
        if self.on_snapshot is not None:
            self.on_snapshot(node.blocks[-1], node.snapshot)
        return True

    @staticmethod
    def snapshots_on_path(match: PrefixMatch, block_size: int
                          ) -> list[tuple[int, Snapshot]]:
        """(position, snapshot) on the matched path, deepest first."""
        out, pos = [], match.num_tokens
        node: RadixNode | None = match.node
        while node is not None and node.parent is not None:
            if node.snapshot is not None:
                out.append((pos, node.snapshot))
            pos -= len(node.blocks) * block_size
            node = node.parent
        return out

    def _drop_snapshot(self, node: RadixNode) -> int:
        """Returns how many sliding blocks this freed (shared ones only lose a reference)."""
        snap, node.snapshot = node.snapshot, None
        if snap is None:
            return 0
        if self.on_snapshot_drop is not None:
            self.on_snapshot_drop(snap)
        freed = sum(self.snapshot_allocator.ref_count(b) == 1 for b in snap.blocks)
        self.snapshot_allocator.free(snap.blocks)
        self.num_snapshots -= 1
        return freed

    def evict_snapshots(self, num_blocks: int) -> int:
        """Drop least recently used snapshots until num_blocks sliding blocks are free."""
        # Pinned paths too: a request resuming from a snapshot holds its own references.
        nodes = sorted((n for n in self._nodes() if n.snapshot is not None),
                       key=lambda n: n.last_access)
        freed = 0
        for node in nodes:
            if freed >= num_blocks:
                break
            freed += self._drop_snapshot(node)
        return freed

    def evictable_snapshot_blocks(self) -> int:
        """Sliding blocks that evict_snapshots() could free right now: those whose every
        reference is a snapshot's (two snapshots may share a block)."""
        refs: Counter[int] = Counter(
            b for n in self._nodes() if n.snapshot is not None for b in n.snapshot.blocks)
        return sum(self.snapshot_allocator.ref_count(b) == k for b, k in refs.items())

    # ------------------------------------------------------------------ eviction

    def evict(self, num_blocks: int) -> int:
        """Free up to num_blocks blocks, LRU leaves first; returns how many were freed."""
        tie = itertools.count()  # deterministic order among equal access times
        heap = [(n.last_access, next(tie), n) for n in self._nodes() if self._evictable_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_blocks:
            _, _, node = heapq.heappop(heap)
            first = node.keys[0]
            while node.blocks and freed < num_blocks and self._tree_only(node.blocks[-1]):
                self._drop_tail(node)
                freed += 1
            if node.blocks:
                continue  # the quota is met, or a live request still holds the rest
            parent = node.parent
            assert parent is not None
            del parent.children[first]
            if self._evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, next(tie), parent))
        return freed

    def evictable_blocks(self) -> int:
        """How many blocks evict() could free right now."""
        total = 0
        gone: set[RadixNode] = set()  # nodes whose whole subtree evict() would remove
        for node in reversed(self._nodes()):  # children before parents
            if node.lock or any(c not in gone for c in node.children.values()):
                continue
            k = 0
            while k < len(node.blocks) and self._tree_only(node.blocks[-1 - k]):
                k += 1
            total += k
            if k == len(node.blocks):
                gone.add(node)
        return total

    # ------------------------------------------------------------------ internals

    def _keys(self, tokens: Tokens, num_tokens: int) -> list[BlockKey]:
        bs = self.block_size
        n = num_tokens // bs
        flat = np.asarray(tokens[: n * bs]).tolist()
        return [tuple(flat[i * bs: (i + 1) * bs]) for i in range(n)]

    def _walk(self, keys: list[BlockKey]) -> tuple[RadixNode, int, list[int]]:
        """Follow keys from the root, touching each node; split the last one where the path
        leaves it, so the returned node ends exactly at the matched length."""
        self._clock += 1
        node, i, blocks = self._root, 0, []
        while i < len(keys):
            child = node.children.get(keys[i])
            if child is None:
                break
            k = 1
            while k < len(child.keys) and i + k < len(keys) and child.keys[k] == keys[i + k]:
                k += 1
            if k < len(child.keys):
                child = self._split(child, k)
            child.last_access = self._clock
            blocks += child.blocks
            node, i = child, i + k
        return node, i, blocks

    @staticmethod
    def _split(child: RadixNode, k: int) -> RadixNode:
        """Cut child after k blocks; returns the new upper part. The original object keeps the
        lower part, so lock handles pointing at it still unlock the whole path."""
        parent = child.parent
        assert parent is not None
        mid = RadixNode(child.keys[:k], child.blocks[:k], parent, child.last_access)
        mid.lock = child.lock  # every lock through child also runs through mid
        parent.children[child.keys[0]] = mid
        child.keys, child.blocks, child.parent = child.keys[k:], child.blocks[k:], mid
        mid.children[child.keys[0]] = child
        return mid

    def _tree_only(self, block: int) -> bool:
        return self.allocator.ref_count(block) == 1

    def _evictable_leaf(self, node: RadixNode) -> bool:
        return (node is not self._root and not node.children and not node.lock
                and bool(node.blocks) and self._tree_only(node.blocks[-1]))

    def _drop_tail(self, node: RadixNode) -> None:
        self._drop_snapshot(node)  # its position is no longer cached
        if self.on_evict is not None:
            self.on_evict(self._prefix_tokens(node), node.blocks[-1])
        if self.events is not None:
            self.events.removed(node.blocks[-1])
        node.keys.pop()
        self.allocator.free([node.blocks.pop()])
        self.num_cached_blocks -= 1
        self.evictions += 1

    @staticmethod
    def _prefix_tokens(node: RadixNode) -> BlockKey:
        """All token ids from the start through the end of node."""
        runs: list[list[BlockKey]] = []
        n: RadixNode | None = node
        while n is not None:
            runs.append(n.keys)
            n = n.parent
        return tuple(t for run in reversed(runs) for key in run for t in key)

    def _nodes(self) -> list[RadixNode]:
        """Every node but the root, parents before children."""
        out: list[RadixNode] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
