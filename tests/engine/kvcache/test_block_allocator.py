from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer.engine.kvcache.block_allocator import BlockAllocator, OutOfBlocks


def test_allocate_free_roundtrip():
    a = BlockAllocator(8, 4)
    ids = a.allocate(5)
    assert len(set(ids)) == 5 and a.num_free == 3
    with pytest.raises(OutOfBlocks):
        a.allocate(4)
    a.free(ids)
    assert a.num_free == 8


def test_shared_block_returns_at_zero_refs():
    a = BlockAllocator(2, 4)
    [b] = a.allocate(1)
    a.share(b)
    a.free([b])
    assert a.num_free == 1 and a.ref_count(b) == 1
    a.free([b])
    assert a.num_free == 2
    with pytest.raises(ValueError):
        a.free([b])


def test_blocks_for_rounds_up():
    a = BlockAllocator(4, 16)
    assert [a.blocks_for(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


@given(st.lists(st.integers(min_value=0, max_value=6), max_size=40))
def test_random_alloc_free_never_loses_blocks(sizes):
    a = BlockAllocator(16, 4)
    held: list[list[int]] = []
    for i, n in enumerate(sizes):
        if i % 3 == 2 and held:
            a.free(held.pop(0))
        elif n <= a.num_free:
            held.append(a.allocate(n))
        live = [b for h in held for b in h]
        assert len(live) == len(set(live))
        assert a.num_free + len(live) == 16
