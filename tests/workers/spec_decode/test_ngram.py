"""The n-gram proposer: its edge cases by hand, and its exact semantics against a naive search."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.workers.spec_decode.ngram import NgramProposer


def propose(tokens: list[int], k: int, min_n: int = 1, max_n: int = 3) -> list[int]:
    return NgramProposer(min_n, max_n).lookup(np.array(tokens, dtype=np.int32), k)


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The specification, spelled out: longest n first, then the most recent earlier start."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[length - n:] if n <= length else None
        # Starts below length - n only: the window starting there is the suffix itself.
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_copies_what_followed_the_earlier_occurrence():
    assert propose([5, 6, 7, 8, 9, 1, 5, 6], k=3) == [7, 8, 9]


def test_history_shorter_than_n():
    assert propose([], k=3) == []
    assert propose([4], k=3) == []  # a lone token has nothing earlier to match
    # Two tokens: the 2-gram has no earlier room, yet the 1-gram [4] matches at position 0.
    assert propose([4, 4], k=3, min_n=1) == [4]
    assert propose([4, 4], k=3, min_n=2) == []
    assert propose([1, 2, 1, 2], k=3, min_n=3, max_n=5) == []  # [2, 1, 2] never occurred


def test_match_at_the_very_start():
    assert propose([1, 2, 3, 9, 9, 1, 2], k=2, min_n=2) == [3, 9]


def test_most_recent_overlapping_occurrence_wins_and_never_the_suffix_itself():
    # [7, 7] occurs at 0, 1, 2 and (the suffix itself) 3: the most recent earlier one is 2.
    assert propose([7, 7, 7, 7, 7], k=4, min_n=2, max_n=2) == [7]
    # Period 3: the suffix [1, 2, 3] occurred at 0 and 3; 3 overlaps the suffix and wins.
    assert propose([1, 2, 3, 1, 2, 3, 1, 2, 3], k=5, min_n=3, max_n=3) == [1, 2, 3]
    # Two disjoint earlier occurrences with different continuations: the later one counts.
    assert propose([8, 1, 8, 2, 8], k=1, min_n=1, max_n=1) == [2]


def test_k_larger_than_what_follows():
    assert propose([3, 4, 5, 3, 4], k=10, min_n=2) == [5, 3, 4]


def test_longer_match_preferred_over_a_more_recent_shorter_one():
    tokens = [1, 2, 3, 40, 41, 9, 3, 50, 51, 1, 2, 3]
    # [3] last occurred at 6 (followed by 50), but [1, 2, 3] occurred at 0 (followed by 40).
    assert propose(tokens, k=2, min_n=1, max_n=3) == [40, 41]
    assert propose(tokens, k=2, min_n=1, max_n=1) == [50, 51]


def test_k_zero_and_no_match():
    assert propose([1, 2, 1, 2], k=0) == []
    assert propose([1, 2, 3, 4], k=3) == []


def test_result_is_plain_ints_and_input_untouched():
    tokens = np.array([9, 8, 9], dtype=np.int32)
    out = NgramProposer(1, 2).lookup(tokens, 4)
    assert out == [8, 9] and all(type(t) is int for t in out)
    assert tokens.tolist() == [9, 8, 9]


@pytest.mark.parametrize("min_n,max_n", [(0, 2), (3, 2)])
def test_bad_n_range(min_n, max_n):
    with pytest.raises(ValueError):
        NgramProposer(min_n, max_n)


@settings(derandomize=True, max_examples=600, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    k=st.integers(0, 8),
    min_n=st.integers(1, 4),
    extra_n=st.integers(0, 3),
    alphabet=st.integers(1, 4),
)
def test_matches_the_naive_reference(tokens, k, min_n, extra_n, alphabet):
    tokens = [t % alphabet for t in tokens]  # small alphabets: many, overlapping matches
    max_n = min_n + extra_n
    got = NgramProposer(min_n, max_n).lookup(np.array(tokens, dtype=np.int32), k)
    assert got == reference(tokens, k, min_n, max_n)
