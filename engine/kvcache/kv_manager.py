"""KV blocks of every request, per KV group, with the prefix cache on the full-attention group.

Groups (engine/kv_layout.py): full-attention layers keep every block of a request; sliding-window
layers keep only the blocks their window can still see, so their memory per request is bounded
by the window W, not by the sequence length. Each group has its own allocator and a request has
one block table per group (a freed sliding block leaves -1 in its table).

Prefix cache (radix tree over the full group): a hit at H reuses blocks [0, H) of the full
layers. Sliding layers need their window too:
- Snapshots: every `snapshot_interval` tokens of a prompt, where the prompt ends and where the
  request finishes (block-aligned), the sliding blocks a query there can still see are kept
  with the tree node for that position. A hit at a snapshot P = H reuses them: no replay, and
  the K/V is the one a cold run computed. A hit past the nearest snapshot P replays [P, H) from
  it (exact), when that costs no more than the mode's replay budget.
- Otherwise the hit replays tokens [R, H), R = H - replay budget rounded down to a block, through
  the model (full layers attend but do not write there) to rebuild the window: W tokens by
  default (bounded, approximate), sliding layers x W with --swa-replay exact.
Only requests whose windows are exact (cold, or hit exactly) leave snapshots behind. The
numerical contract is in the README ("Prefix caching and sliding windows").
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from deepinfer.engine.kv_layout import FULL, SLIDING, KVGroup
from deepinfer.engine.kvcache.block_allocator import BlockAllocator
from deepinfer.engine.kvcache.radix_cache import RadixCache, Snapshot
from deepinfer.engine.request import Request

if TYPE_CHECKING:  # the connectors build on this module
    from deepinfer.engine.kvcache.connectors.base import KVConnector
    from deepinfer.engine.kvcache.kv_events import KVEventLog


def cache_tokens(req: Request, tokens: np.ndarray) -> np.ndarray:
    """The ids the prefix cache (and every tier, through the block digests) files a request's
    tokens under: a LoRA request's are its adapter's own (ids shifted above 2^32 by the
    adapter's salt, engine/kv_identity.py adapter_salt), so two adapters, or an adapter and the
    base model, never share KV for the same tokens; a client's cache_salt is mixed into that
    salt (engine/kv_identity.py request_salt), keeping its requests' KV to themselves."""
    if not req.cache_salt:
        return tokens
    return np.asarray(tokens, dtype=np.int64) + (req.cache_salt << 32)


class KVManager:
    def __init__(
        self, num_blocks: int, block_size: int, groups: list[KVGroup],
        prefix_caching: bool = True, replay_tokens: int | None = None,
        snapshot_interval: int = 0,
    ) -> None:
        kinds = [g.kind for g in groups]
        if kinds.count(SLIDING) > 1:
            raise ValueError("one sliding-window size per model is supported")
        sliding = next((g for g in groups if g.kind == SLIDING), None)
        window = sliding.window if sliding is not None else None
        self.block_size = block_size
        # Tokens a hit recomputes for sliding layers: W (bounded, approximate) by default;
        # sliding_layers * W makes the rebuilt windows exact (see README).
        self.replay_tokens = replay_tokens if replay_tokens is not None else (window or 0)
        # What a replay must cover to be exact, whatever the mode: each sliding layer's window
        # depends on the previous layer's window before it.
        self.exact_replay = max(1, sliding.depth or len(sliding.layers)) * window if sliding else 0
        self.groups = kinds
        self.window = window
        self.allocators = [BlockAllocator(num_blocks, block_size) for _ in groups]
        self.full = kinds.index(FULL) if FULL in kinds else None
        self.sliding = kinds.index(SLIDING) if SLIDING in kinds else None
        self._sliding_allocator = (self.allocators[self.sliding] if self.sliding is not None
                                   else None)
        # Without full-attention layers nothing exact can be reused: no prefix cache.
        self.cache = (RadixCache(self.allocators[self.full], block_size,
                                 snapshot_allocator=self._sliding_allocator)
                      if prefix_caching and self.full is not None else None)
        # Sliding-window snapshots need the window's blocks at a block-aligned position.
        self.snapshots = self.cache is not None and self.sliding is not None and bool(window)
        # Snapshots inside long prompts too, every this many tokens (block-aligned; 0: none), so
        # a hit between two replays from the nearest one, not from a window before it.
        self.snapshot_interval = snapshot_interval // block_size * block_size
        self.replayed_tokens = 0
        self.snapshot_hits = 0  # hits that resumed the sliding layers from a snapshot
        self._evictable, self._evictable_at = 0, float("-inf")
        # KV connectors (engine/kvcache/connectors): offered evicted blocks, asked to continue
        # prefix hits, in order (`attach`).
        self.connectors: list[KVConnector] = []

    def attach(self, connectors: list[KVConnector]) -> None:
        self.connectors = list(connectors)
        if self.cache is not None:
            self.cache.on_evict = self._on_evict
            self.cache.on_insert = self._on_insert
            self.cache.on_snapshot = self._on_snapshot
            self.cache.on_snapshot_drop = self._on_snapshot_drop

    def report_events(self, log: KVEventLog) -> None:
        """KV events (--kv-events-config): the prefix cache and every tier report the blocks
        they store and drop to `log`."""
        if self.cache is not None:
            self.cache.events = log
        for c in self.connectors:
            c.report_events(log)

    def _on_evict(self, tokens, device_block: int) -> None:
        for c in self.connectors:
            c.on_evict(tokens, device_block)

    def _on_insert(self, parent_block: int | None, tokens, blocks: list[int]) -> None:
        for c in self.connectors:
            c.on_stored(parent_block, tokens, blocks)

    def _on_snapshot(self, full_block: int, snapshot: Snapshot) -> None:
        for c in self.connectors:
            c.on_snapshot(full_block, snapshot)

    def _on_snapshot_drop(self, snapshot: Snapshot) -> None:
        for c in self.connectors:
            c.on_snapshot_drop(snapshot)

    # ------------------------------------------------------------------ capacity

    @property
    def num_blocks(self) -> int:
        return self.allocators[0].num_blocks

    def num_free(self) -> int:
        """Free blocks over all groups (evictable cached blocks not counted)."""
        return sum(a.num_free for a in self.allocators)

    def num_reusable(self, max_age: float = 0.0) -> int:
        """Free blocks plus cached blocks no request uses (evicted on demand).

        Counting the evictable ones walks the tree (~1 ms per 1000 nodes), so a caller on the
        hot path may accept a count up to `max_age` seconds old.
        """
        if self.cache is None:
            return self.num_free()
        now = time.monotonic()
        if now - self._evictable_at > max_age:
            evictable = self.cache.evictable_blocks()
            if self.snapshots:
                evictable += self.cache.evictable_snapshot_blocks()
            self._evictable, self._evictable_at = evictable, now
        return self.num_free() + self._evictable

    def num_total(self) -> int:
        return sum(a.num_blocks for a in self.allocators)

    def _available(self, g: int) -> int:
        free = self.allocators[g].num_free
        if g == self.full and self.cache is not None and free < self.num_blocks:
            free += self.cache.evictable_blocks()
        elif g == self.sliding and self.snapshots and free < self.num_blocks:
            free += self.cache.evictable_snapshot_blocks()
        return free

    def needs(self, req: Request, upto: int) -> list[int]:
        """New blocks per group for the request to hold `upto` tokens."""
        n = self.allocators[0].blocks_for(upto)
        return [max(0, n - len(t)) for t in req.tables]

    def can_allocate(self, needs: list[int]) -> bool:
        return all(n <= self.allocators[g].num_free or n <= self._available(g)
                   for g, n in enumerate(needs) if n)

    def allocate(self, req: Request, needs: list[int]) -> None:
        for g, n in enumerate(needs):
            if not n:
                continue
            short = n - self.allocators[g].num_free
            if short > 0 and g == self.full and self.cache is not None:
                self.cache.evict(short)
            elif short > 0 and g == self.sliding and self.snapshots:
                self.cache.evict_snapshots(short)
            req.tables[g] += self.allocators[g].allocate(n)

    def drop_outside_window(self, req: Request, next_pos: int) -> None:
        """Free sliding blocks that no query at next_pos or later can see (keys > q - W)."""
        if self.sliding is None or self.window is None:
            return
        table = req.tables[self.sliding]
        # Block j is invisible once its last key (j+1)*bs - 1 <= next_pos - W.
        last_dead = (next_pos - self.window + 1) // self.block_size
        for j in range(min(last_dead, len(table))):
            if table[j] >= 0:
                self.allocators[self.sliding].free([table[j]])
                table[j] = -1

    def trim(self, req: Request, upto: int) -> None:
        """Free the request's blocks past the ones `upto` tokens need (rejected draft slots)."""
        keep = self.allocators[0].blocks_for(upto)
        for g, table in enumerate(req.tables):
            extra = [b for b in table[keep:] if b >= 0]
            if extra:
                self.allocators[g].free(extra)
            del table[keep:]

    def release(self, req: Request) -> None:
        """Free the request's blocks (cached ones stay in the tree) and unpin its prefix."""
        for g, table in enumerate(req.tables):
            self.allocators[g].free([b for b in table if b >= 0])
        req.tables = [[] for _ in self.groups]
        if req.cache_node is not None and self.cache is not None:
            self.cache.unlock(req.cache_node)
        req.cache_node = None

    # ------------------------------------------------------------------ prefix cache

    def match_prefix(self, req: Request, reuse: bool = True) -> bool:
        """On admission: reuse the longest cached prefix and set where computing starts.
        `reuse` False: compute the whole prompt (it needs every position's logits). Returns
        whether the request must first wait for loads from a tier (LOADING)."""
        req.hit_tokens = req.full_kv_from = req.window_from = req.replayed_tokens = 0
        if self.cache is None or req.num_computed or not reuse:
            return False
        # At least one token is computed: its logits give the next token.
        tokens = cache_tokens(req, req.tokens(0, req.num_tokens))
        match = self.cache.match(tokens, max_tokens=req.num_tokens - 1)
        self.cache.lock(match)
        req.cache_node = match.node
        hit = match.num_tokens
        if hit:
            req.shortcuts.add("prefix_device")
        req.tables[self.full] = list(match.blocks)
        for connector in self.connectors:  # each continues the hit where the last left off
            loaded = self._load_from_connector(connector, req, tokens, hit)
            if loaded:
                req.shortcuts.add("prefix_" + connector.name.removesuffix("_tier"))
            hit += loaded
        req.hit_tokens = hit
        start = hit
        req.window_exact, req.snapshot_hit = True, False
        if self.sliding is not None and hit:
            # SWA bounded replay: recompute [R, H) so sliding layers have their window.
            replay_from = max(0, hit - self.replay_tokens) // self.block_size * self.block_size
            shared = self._nearest_snapshot(match, hit, replay_from)
            snapshot = shared or self._load_snapshot(tokens, hit, replay_from)
            if snapshot is not None:
                replay_from, snap = snapshot
                self.snapshot_hits += 1
                req.snapshot_hit = True
                req.shortcuts.add("swa_snapshot")
                if shared is not None:  # the tree's, shared (a loaded one is the request's)
                    for b in snap.blocks:
                        self._sliding_allocator.share(b)
                req.tables[self.sliding] = [-1] * snap.first + list(snap.blocks)
                req.window_from = snap.first * self.block_size
            else:
                req.tables[self.sliding] = [-1] * (replay_from // self.block_size)
                req.window_from = replay_from
                # Exact only when the replay reaches back past every sliding layer's window.
                req.window_exact = replay_from == 0 or hit - replay_from >= self.exact_replay
                if hit > replay_from:
                    req.shortcuts.add("swa_replay_" + ("exact" if req.window_exact else "window"))
            self.replayed_tokens += hit - replay_from
            req.replayed_tokens = hit - replay_from
            start = replay_from
        req.full_kv_from = hit
        req.num_computed = start
        waits = False
        for connector in self.connectors:  # (each is asked: the call hands over its loads)
            waits = connector.loads_wait(req) or waits
        return waits

    def remote_window_start(self, num_tokens: int) -> int:
        """First sliding block a query right after `num_tokens` prompt tokens still sees."""
        return max(0, num_tokens - self.window + 1) // self.block_size if self.window else 0

    def admit_remote(self, req: Request, remote_tables: list[list[int]]
                     ) -> list[list[tuple[int, int]]] | None:
        """Blocks for a request whose prompt KV is on another server (prefill/decode
        disaggregation), room for the first token included: the full group reuses this
        server's own prefix cache and a sliding group takes only the window's blocks. Returns
        per group the (remote, local) block pairs still to copy, or None (nothing held) when
        they do not fit now."""
        n = req.num_prompt
        req.hit_tokens = req.replayed_tokens = 0
        starts = [0] * len(self.groups)
        if self.cache is not None:
            match = self.cache.match(cache_tokens(req, req.prompt_ids), max_tokens=n)
            self.cache.lock(match)
            req.cache_node = match.node
            req.tables[self.full] = list(match.blocks)
            req.hit_tokens = match.num_tokens
            starts[self.full] = len(match.blocks)
        if self.sliding is not None:
            starts[self.sliding] = self.remote_window_start(n)
            req.tables[self.sliding] = [-1] * starts[self.sliding]
        need = self.needs(req, n + 1)
        if not self.can_allocate(need):
            self.unmatch_prefix(req)
            return None
        self.allocate(req, need)
        end = self.allocators[0].blocks_for(n)
        req.num_computed = req.full_kv_from = n
        req.window_from = starts[self.sliding] * self.block_size if self.sliding is not None else 0
        req.window_exact, req.snapshot_hit = True, False
        return [[(remote_tables[g][j], table[j]) for j in range(starts[g], end)]
                for g, table in enumerate(req.tables)]

    def _nearest_snapshot(self, match, hit: int, replay_from: int):
        """(position, snapshot) to resume the sliding layers from: the deepest on the matched
        path at or after `replay_from` (a replay from it costs no more than the budget)."""
        if not self.snapshots or match.num_tokens != hit:  # host-tier blocks carry none
            return None
        for pos, snap in RadixCache.snapshots_on_path(match, self.block_size):
            if pos >= replay_from:
                return pos, snap
        return None

    def _load_snapshot(self, tokens, hit: int, replay_from: int
                       ) -> tuple[int, Snapshot] | None:
        """(position, snapshot) a connector holds at or after `replay_from` (the deepest), its
        sliding blocks allocated here and their load planned; None when none has one or the
        sliding blocks are short."""
        bs = self.block_size
        for connector in self.connectors:
            found = connector.match_snapshot(tokens, hit, replay_from)
            if found is None:
                continue
            pos, handle = found
            first = max(0, pos - self.window + 1) // bs
            n = pos // bs - first
            allocator = self._sliding_allocator
            if n > allocator.num_free:
                self.cache.evict_snapshots(n - allocator.num_free)
            if n > allocator.num_free:
                return None
            blocks = allocator.allocate(n)
            connector.plan_snapshot_load(handle, blocks)
            return pos, Snapshot(first, blocks)
        return None

    def _load_from_connector(self, connector: KVConnector, req: Request, tokens, hit: int
                             ) -> int:
        """Continue a hit from the connector's blocks; returns the extra cached tokens."""
        found = connector.match(tokens, hit, req.num_tokens - 1)  # pinned from here on
        allocator = self.allocators[self.full]
        short = len(found) - allocator.num_free
        if short > 0:
            self.cache.evict(short)
        found = found[: allocator.num_free]
        if not found:
            return 0
        device = allocator.allocate(len(found))
        for h, d in zip(found, device):
            connector.plan_load(h, d)
        req.tables[self.full] += device
        self.cache.hits_tokens += len(found) * self.block_size
        return len(found) * self.block_size

    def unmatch_prefix(self, req: Request) -> None:
        """Undo match_prefix for a request that could not be admitted after all."""
        if self.full is not None:
            for connector in self.connectors:
                connector.cancel_loads(req.tables[self.full])
        if self.cache is not None and req.cache_node is not None:
            self.cache.hits_tokens -= req.hit_tokens  # it will be looked up again
            self.cache.queries_tokens -= req.num_tokens
            self.replayed_tokens -= req.replayed_tokens
            self.snapshot_hits -= req.snapshot_hit
        self.release(req)
        req.num_computed = req.hit_tokens = req.full_kv_from = req.window_from = 0
        req.replayed_tokens = 0

    def cache_request(self, req: Request) -> None:
        """Offer the request's computed full blocks to the prefix cache, with a snapshot of
        its sliding window where they end."""
        if self.cache is None or not req.tables[self.full]:
            return
        computed = min(req.num_computed, req.num_tokens)
        tokens = cache_tokens(req, req.tokens(0, computed))
        self.cache.insert(tokens, req.tables[self.full])
        self._snapshot(req, tokens, computed // self.block_size * self.block_size)

    def cache_prefill(self, req: Request, start: int, end: int) -> None:
        """Called when a step computes prompt tokens [start, end): cache the full blocks and a
        sliding-window snapshot at every snapshot point it passes (each `snapshot_interval`
        tokens) and, when it computes the prompt's end, at the last block boundary before the
        prompt's last token, the longest hit the same prompt can make. (The blocks are written
        in this step, before any later step can read them.)"""
        if not self.snapshots:
            return
        last = (req.num_prompt - 1) // self.block_size * self.block_size
        points = []
        if self.snapshot_interval and req.window_exact:
            step = self.snapshot_interval
            points = list(range((start // step + 1) * step, min(end, last) + 1, step))
        if start < req.num_prompt <= end and last not in points:
            points.append(last)
        for pos in points:
            tokens = cache_tokens(req, req.prompt_ids[:pos])
            self.cache.insert(tokens, req.tables[self.full])
            self._snapshot(req, tokens, pos)

    def _snapshot(self, req: Request, tokens, pos: int) -> None:
        """Keep the request's sliding blocks that a query at `pos` sees, when it still has
        them all and they hold the exact window."""
        if not self.snapshots or pos <= 0 or not req.window_exact:
            return
        table = req.tables[self.sliding]
        first = max(0, pos - self.window + 1) // self.block_size
        blocks = table[first: pos // self.block_size]
        if len(blocks) == pos // self.block_size - first and all(b >= 0 for b in blocks):
            self.cache.add_snapshot(tokens, pos, Snapshot(first, blocks))
