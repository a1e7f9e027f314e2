"""Router placement policies, on their own (the e2e tests run them in front of real replicas)."""

from __future__ import annotations

import pytest

from deepinfer.frontend.router.policy import Policy, PrefixIndex, Replica


def replicas(n: int = 2) -> list[Replica]:
    return [Replica(f"http://r{i}") for i in range(n)]


def test_prefix_index_matches_whole_chunks_of_the_longest_indexed_prefix():
    index = PrefixIndex(chunk=4)
    index.insert("abcdefghij")
    assert index.match("abcdefgh-other") == 8
    assert index.match("abcdXXXXefgh") == 4
    assert index.match("xbcdefgh") == 0
    small = PrefixIndex(chunk=4, capacity=2)  # least recently used first out
    small.insert("aaaabbbbcccc")
    assert small.match("aaaabbbbcccc") == 0  # its first chunk was evicted: no chain left


def test_cache_aware_keeps_a_prefix_on_its_replica_and_spreads_the_rest():
    policy, rs = Policy("cache_aware"), replicas()
    system = "You are a helpful assistant. " * 10
    first = policy.choose(system + "Question one?", rs)
    again = [policy.choose(system + f"Question {i}?", rs) for i in range(5)]
    assert all(r is first for r in again) and first.prefix_routed == 5
    other = next(r for r in rs if r is not first)
    distinct = [policy.choose(f"{i} unrelated prompt " * 8, rs).url for i in range(6)]
    # no cached prefix anywhere: the least-loaded, then least-routed replica
    assert distinct.count(other.url) >= 5 and abs(first.routed - other.routed) <= 1


def test_cache_aware_gives_way_to_load_imbalance():
    policy, rs = Policy("cache_aware", balance_abs_threshold=2), replicas()
    text = "shared prefix " * 20
    home = policy.choose(text, rs)
    home.in_flight = 10  # busy: more than 2 beyond the other and 1.5x as many
    assert policy.choose(text, rs) is not home


def test_round_robin_and_least_load():
    rr, rs = Policy("round_robin"), replicas(3)
    assert [rr.choose("same", rs).url for _ in range(6)] == [r.url for r in rs] * 2
    least, rs = Policy("least_load"), replicas(3)
    rs[0].in_flight, rs[1].in_flight, rs[2].in_flight = 3, 1, 2
    assert least.choose("x", rs) is rs[1]
    assert Policy().choose("x", []) is None
    with pytest.raises(ValueError, match="--policy must be one of"):
        Policy("random")
