from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from deepinfer.engine.kvcache.block_allocator import BlockAllocator
from deepinfer.engine.kvcache.radix_cache import PrefixMatch, RadixCache

BS = 4


def make(num_blocks: int = 32, on_evict=None) -> tuple[BlockAllocator, RadixCache]:
    alloc = BlockAllocator(num_blocks, BS)
    return alloc, RadixCache(alloc, BS, on_evict=on_evict)


def run_request(alloc: BlockAllocator, cache: RadixCache, prompt, max_tokens=None):
    """Match + lock, allocate the rest, insert; returns (match, block table)."""
    m = cache.match(prompt, max_tokens)
    cache.lock(m)
    blocks = m.blocks + alloc.allocate(alloc.blocks_for(len(prompt)) - len(m.blocks))
    cache.insert(prompt, blocks)
    return m, blocks


def finish(alloc: BlockAllocator, cache: RadixCache, m: PrefixMatch, blocks: list[int]) -> None:
    cache.unlock(m.node)
    alloc.free(blocks)


def tree_blocks(cache: RadixCache) -> list[int]:
    return [b for n in cache._nodes() for b in n.blocks]


def test_insert_then_match_full_blocks_only():
    alloc, cache = make()
    prompt = np.arange(10, dtype=np.int32)  # 2 full blocks + a 2-token tail
    blocks = alloc.allocate(3)
    assert cache.insert(prompt, blocks) == 8
    assert cache.num_cached_blocks == 2
    assert [alloc.ref_count(b) for b in blocks] == [2, 2, 1]  # the tail block is not cached
    m = cache.match(list(range(12)))
    assert m.blocks == blocks[:2] and m.num_tokens == 8
    assert cache.match([0, 1, 2, 3, 4, 5, 6]).blocks == blocks[:1]  # second block incomplete
    assert cache.match([9, 1, 2, 3]).num_tokens == 0
    assert cache.insert(prompt, blocks) == 0  # already cached
    alloc.free(blocks)
    assert alloc.num_free == alloc.num_blocks - 2


def test_max_tokens_caps_the_match():
    alloc, cache = make()
    prompt = list(range(8))
    cache.insert(prompt, alloc.allocate(2))
    assert cache.match(prompt).num_tokens == 8
    assert cache.match(prompt, max_tokens=len(prompt) - 1).num_tokens == 4
    assert cache.match(prompt, max_tokens=0).num_tokens == 0


def test_match_inside_a_node_splits_it():
    alloc, cache = make()
    a = list(range(16))
    blocks = alloc.allocate(4)
    cache.insert(a, blocks)
    assert len(cache._nodes()) == 1
    m = cache.match(a[:8] + [99] * 8)
    assert m.blocks == blocks[:2] and len(cache._nodes()) == 2
    assert m.node.blocks == blocks[:2] and list(m.node.children.values())[0].blocks == blocks[2:]
    assert cache.match(a).blocks == blocks  # the split path still matches in full
    assert cache.num_cached_blocks == 4


def test_two_requests_share_a_prefix_and_branch():
    alloc, cache = make()
    base = list(range(8))
    a, b = base + [1] * 4, base + [2] * 4
    ma, blocks_a = run_request(alloc, cache, a)
    mb, blocks_b = run_request(alloc, cache, b)
    assert mb.blocks == blocks_a[:2] and blocks_b[:2] == blocks_a[:2]
    assert cache.num_cached_blocks == 4  # shared 2 + one branch block each
    assert len(cache._root.children) == 1
    shared = cache._root.children[tuple(base[:4])]
    assert shared.blocks == blocks_a[:2] and len(shared.children) == 2
    assert cache.match(a).blocks == blocks_a and cache.match(b).blocks == blocks_b
    assert alloc.ref_count(blocks_a[0]) == 3  # tree + both requests
    finish(alloc, cache, ma, blocks_a)
    finish(alloc, cache, mb, blocks_b)
    assert cache.evictable_blocks() == 4
    assert cache.evict(100) == 4
    assert alloc.num_free == alloc.num_blocks and cache.num_cached_blocks == 0


def test_duplicate_blocks_keep_the_tree_copy():
    alloc, cache = make()
    prompt = list(range(12))
    first = alloc.allocate(3)
    cache.insert(prompt, first)
    alloc.free(first)
    dup = alloc.allocate(3)  # computed without a match: same tokens, other blocks
    assert cache.insert(prompt + [7] * 4, dup + alloc.allocate(1)) == 4
    assert [alloc.ref_count(b) for b in dup] == [1, 1, 1]  # duplicates not taken
    assert cache.match(prompt + [7] * 4).blocks[:3] == first


def test_lock_prevents_eviction():
    alloc, cache = make()
    blocks = alloc.allocate(3)
    cache.insert(list(range(8)) + [1] * 4, blocks)
    alloc.free(blocks)
    m = cache.match(list(range(8)) + [2] * 4)  # locks the first two blocks only
    cache.lock(m)
    alloc.free(m.blocks)  # drop the request's references: only the lock protects them now
    assert cache.evictable_blocks() == 1 and cache.evict(10) == 1  # the unlocked branch
    assert cache.evict(10) == 0 and cache.num_cached_blocks == 2
    cache.unlock(m.node)
    assert cache.evict(10) == 2 and alloc.num_free == alloc.num_blocks
    with pytest.raises(ValueError):
        cache.unlock(m.node)


def test_blocks_held_by_a_running_request_are_not_freed():
    alloc, cache = make()
    m, blocks = run_request(alloc, cache, list(range(8)))  # inserted while still running
    assert cache.evictable_blocks() == 0 and cache.evict(10) == 0
    finish(alloc, cache, m, blocks)
    assert cache.evict(10) == 2


def test_lru_order_and_tail_first():
    seen = []
    alloc, cache = make(on_evict=lambda key, b: seen.append((key, b)))
    prompts = [[i] * 8 for i in range(3)]
    tables = {}
    for p in prompts:
        blocks = alloc.allocate(2)
        cache.insert(p, blocks)
        alloc.free(blocks)
        tables[p[0]] = blocks
    cache.match(prompts[0])  # 0 becomes the most recent; 1 is the oldest
    assert cache.evict(1) == 1
    assert seen == [(tuple(prompts[1]), tables[1][1])]  # tail block first, full prefix as key
    assert cache.match(prompts[1]).blocks == tables[1][:1]  # what stays is a valid prefix
    assert cache.evict(2) == 2  # the match touched 1 again: 2 is now the oldest
    assert [b for _, b in seen[1:]] == tables[2][::-1]
    assert cache.evictions == 3 and cache.num_cached_blocks == 3


def test_parents_become_leaves_and_are_evicted():
    alloc, cache = make()
    base = list(range(8))
    for tail in (1, 2):
        blocks = alloc.allocate(3)
        cache.insert(base + [tail] * 4, blocks)
        alloc.free(blocks)
    assert cache.num_cached_blocks == 4
    assert cache.evict(100) == 4 and not cache._root.children
    assert alloc.num_free == alloc.num_blocks


def test_hit_counters_count_on_lock():
    alloc, cache = make()
    m, blocks = run_request(alloc, cache, list(range(8)))
    m2 = cache.match(list(range(8)), max_tokens=7)
    cache.match(list(range(8)))  # a lookup that is not admitted does not count
    cache.lock(m2)
    assert cache.queries_tokens == 16 and cache.hits_tokens == 4


def test_block_size_must_match_the_allocator():
    with pytest.raises(ValueError):
        RadixCache(BlockAllocator(4, 4), 8)


# ---------------------------------------------------------------------- property-based


# Prompts are built from a few block-sized words plus a short tail, so prefixes collide often.
WORDS = [[0, 0, 0, 0], [0, 0, 0, 1], [1, 1, 1, 1]]
PROMPTS = st.builds(
    lambda words, tail: [t for w in words for t in WORDS[w]] + tail,
    st.lists(st.integers(0, len(WORDS) - 1), max_size=4),
    st.lists(st.integers(0, 1), max_size=BS - 1),
)


class CacheMachine(RuleBasedStateMachine):
    """Requests come and go with colliding prompts; a model tracks which prefixes are cached."""

    NUM_BLOCKS = 24

    def __init__(self) -> None:
        super().__init__()
        self.alloc = BlockAllocator(self.NUM_BLOCKS, BS)
        self.cache = RadixCache(self.alloc, BS, on_evict=self._evicted)
        self.model: set[tuple[int, ...]] = set()  # every cached block-aligned prefix
        self.live: list[tuple[list[int], PrefixMatch, list[int]]] = []

    def _evicted(self, key: tuple[int, ...], block: int) -> None:
        assert key in self.model and self.alloc.ref_count(block) == 1
        self.model.remove(key)

    def _expected_match(self, prompt: list[int], cap: int) -> int:
        j = cap // BS
        while j and tuple(prompt[: j * BS]) not in self.model:
            j -= 1
        return j * BS

    @rule(prompt=PROMPTS, insert_now=st.booleans())
    def start(self, prompt: list[int], insert_now: bool) -> None:
        cap = max(0, len(prompt) - 1)
        m = self.cache.match(np.asarray(prompt, dtype=np.int32), max_tokens=cap)
        assert m.num_tokens == self._expected_match(prompt, cap) == len(m.blocks) * BS
        self.cache.lock(m)
        need = self.alloc.blocks_for(len(prompt)) - len(m.blocks)
        if need > self.alloc.num_free:
            self.cache.evict(need - self.alloc.num_free)
        if need > self.alloc.num_free:  # cannot admit: give the references back
            self.cache.unlock(m.node)
            self.alloc.free(m.blocks)
            return
        blocks = m.blocks + self.alloc.allocate(need)
        if insert_now:  # the scheduler may cache right after prefill, while running
            self._insert(prompt, blocks)
        self.live.append((prompt, m, blocks))

    def _insert(self, prompt: list[int], blocks: list[int]) -> None:
        before = self.cache.num_cached_blocks
        added = self.cache.insert(prompt, blocks)
        assert self.cache.num_cached_blocks - before == added // BS
        for j in range(1, len(prompt) // BS + 1):
            self.model.add(tuple(prompt[: j * BS]))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), insert=st.booleans())
    def finish(self, i: int, insert: bool) -> None:
        prompt, m, blocks = self.live.pop(i % len(self.live))
        if insert:
            self._insert(prompt, blocks)
        self.cache.unlock(m.node)
        self.alloc.free(blocks)

    @rule(n=st.integers(0, 8))
    def evict(self, n: int) -> None:
        expect = min(n, self.cache.evictable_blocks())
        free_before = self.alloc.num_free
        assert self.cache.evict(n) == expect == self.alloc.num_free - free_before

    @rule(prompt=PROMPTS)
    def lookup(self, prompt: list[int]) -> None:
        assert self.cache.match(prompt).num_tokens == self._expected_match(prompt, len(prompt))

    @invariant()
    def consistent(self) -> None:
        alloc, cache = self.alloc, self.cache
        cached = tree_blocks(cache)
        held = [b for _, _, blocks in self.live for b in blocks]
        assert len(set(cached)) == len(cached) == cache.num_cached_blocks
        free = set(alloc._free)
        assert not free & set(cached) and not free & set(held)
        assert all(alloc.ref_count(b) >= 1 for b in cached)
        # every reference is the tree's or a live request's
        refs = {b: alloc.ref_count(b) for b in range(alloc.num_blocks)}
        expect = dict.fromkeys(range(alloc.num_blocks), 0)
        for b in cached + held:
            expect[b] += 1
        assert refs == expect
        assert alloc.num_free + len(set(cached) | set(held)) == alloc.num_blocks
        # the tree holds exactly the model's prefixes, and lock counts match the live requests
        paths, locks = set(), {}
        for node in cache._nodes():
            locks[node] = 0
            prefix = cache._prefix_tokens(node)
            for j in range(len(prefix) // BS - len(node.keys) + 1, len(prefix) // BS + 1):
                paths.add(prefix[: j * BS])
        for _, m, _ in self.live:
            n = m.node
            while n is not cache._root:
                locks[n] += 1
                n = n.parent
        assert paths == self.model
        assert all(node.lock == locks[node] for node in locks)

    def teardown(self) -> None:
        for _, m, blocks in self.live:
            self.cache.unlock(m.node)
            self.alloc.free(blocks)
        self.live = []
        n = self.cache.num_cached_blocks
        assert self.cache.evictable_blocks() == n
        assert self.cache.evict(10**9) == n
        assert self.cache.num_cached_blocks == 0 and not self.model
        assert self.alloc.num_free == self.alloc.num_blocks


CacheMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_cache_machine = CacheMachine.TestCase
