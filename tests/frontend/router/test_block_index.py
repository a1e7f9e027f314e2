"""The router's exact index from KV events (plain decoded lists, as they arrive), and the
cache-aware policy reading it."""

from __future__ import annotations

from deepinfer.frontend.router.block_index import BlockIndex
from deepinfer.frontend.router.policy import Policy, Replica

BS = 4
A, B = "http://a", "http://b"


def stored(hashes, parent, tokens, medium="GPU"):
    return ["BlockStored", hashes, parent, tokens, BS, None, medium]


def test_longest_prefix_per_replica_with_eviction_and_restart():
    index = BlockIndex()
    prompt = list(range(12))
    index.apply(A, [["AllBlocksCleared"], stored([1, 2], None, prompt[:8])])
    index.apply(B, [["AllBlocksCleared"], stored([9], None, prompt[:4])])
    index.apply(A, [stored([3], 2, prompt[8:12])])
    assert index.match(prompt + [99], [A, B]) == {A: 12, B: 4}
    # Other hashes for the same tokens (another identity) still match by content.
    assert index.match(prompt[:4] + [5, 5, 5, 5], [A, B]) == {A: 4, B: 4}
    index.apply(A, [["BlockRemoved", [2], "GPU"]])  # a hole: the prefix ends before it
    assert index.match(prompt, [A, B]) == {A: 4, B: 4}
    index.apply(B, [["AllBlocksCleared"]])
    assert index.match(prompt, [A, B]) == {A: 4, B: 0}
    assert index.match(prompt, ["http://silent"]) == {}  # publishes nothing: no entry


def test_a_block_stays_while_another_tier_holds_it():
    index = BlockIndex()
    index.apply(A, [stored([1], None, [1, 2, 3, 4]), stored([1], None, [1, 2, 3, 4], "CPU"),
                    ["BlockRemoved", [1], "GPU"]])
    assert index.match([1, 2, 3, 4], [A]) == {A: 4}
    index.apply(A, [["BlockRemoved", [1], "CPU"]])
    assert index.match([1, 2, 3, 4], [A]) == {A: 0} and index.num_blocks(A) == 0


def test_policy_places_by_events_and_guesses_for_silent_replicas():
    index = BlockIndex()
    policy = Policy()
    policy.block_index = index
    a, b, silent = Replica(A), Replica(B), Replica("http://silent")
    tokens = list(range(16))
    index.apply(A, [["AllBlocksCleared"]])
    index.apply(B, [stored([1, 2, 3], None, tokens[:12])])
    a.in_flight = 0
    b.in_flight = 3  # busier, but it holds the prefix
    assert policy.choose("some text", [a, b], tokens) is b
    # Nobody holds anything: least load.
    assert policy.choose("other", [a, b], [7] * 16) is a
    # A silent replica is judged by what the router sent it.
    silent.index.insert("x" * 200)
    assert policy.choose("x" * 200, [a, silent], [5] * 16) is silent


def test_the_router_tokenizes_requests_as_the_server_does(default_model):
    from deepinfer.engine.protocol import ChatMessage
    from deepinfer.engine.tokenizer.tokenizer import Tokenizer, chat_dict
    from deepinfer.frontend.router.kv_events import RequestTokens

    tokens, server = RequestTokens(str(default_model)), Tokenizer(str(default_model))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = server.encode_chat([chat_dict(ChatMessage(**m)) for m in messages])[1]
    assert tokens("/v1/chat/completions", {"messages": messages}) == expected
    assert tokens("/v1/completions", {"prompt": "Hello there"}) == server.encode("Hello there")
    assert tokens("/v1/completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]
    # What the server would render its own way is left to the approximate index.
    assert tokens("/v1/chat/completions", {"messages": messages, "tools": [{}]}) is None
    assert tokens("/v1/messages", {"messages": messages}) is None


def test_an_adapters_blocks_match_only_requests_of_that_adapter():
    index = BlockIndex()
    prompt = list(range(8))
    sql = ["BlockStored", [5, 6], None, prompt, BS, 77, "GPU", "sql"]
    index.apply(A, [["AllBlocksCleared"], sql])
    index.apply(B, [["AllBlocksCleared"], stored([1, 2], None, prompt)])
    assert index.match(prompt, [A, B], "sql") == {A: 8, B: 0}
    assert index.match(prompt, [A, B], "base") == {A: 0, B: 8}  # not an adapter: base blocks
    assert index.match(prompt, [A, B]) == {A: 0, B: 8}
    assert index.match(prompt, [A, B], "chat") == {A: 0, B: 8}  # an adapter nobody caches
    index.apply(A, [["BlockRemoved", [6], "GPU"]])
    assert index.match(prompt, [A, B], "sql") == {A: 4, B: 0}
    policy = Policy()
    policy.block_index = index
    replicas = [Replica(A), Replica(B)]
    assert policy.choose("x", replicas, prompt, "base").url == B


def test_a_salted_requests_blocks_are_matched_by_no_request():
    """Blocks with a lora_id and no adapter name are a client's cache_salt's: the replica
    serves them only to requests of that salt, which the router cannot tell apart."""
    index = BlockIndex()
    prompt = [1, 2, 3, 4]
    index.apply(A, [["BlockStored", [1], None, prompt, BS, 12345, "GPU", None]])
    assert index.match(prompt, [A]) == {A: 0} and index.num_blocks(A) == 1
