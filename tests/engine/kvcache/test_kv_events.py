"""The block digest, and the KV events the prefix cache and the host tier log (decoded as plain
msgpack lists, the way an external router sees them)."""

from __future__ import annotations

import msgspec
import numpy as np

from deepinfer.engine.kv_identity import identity_key
from deepinfer.engine.kvcache.block_allocator import BlockAllocator
from deepinfer.engine.kvcache.block_hash import block_digest, chain, external_hash
from deepinfer.engine.kvcache.connectors.host_tier import HostTier
from deepinfer.engine.kvcache.kv_events import KVEventLog
from deepinfer.engine.kvcache.radix_cache import RadixCache

BS = 4
ID = identity_key("tiny:LlamaForCausalLM", "float32", "float32", BS, "tp1")


def test_same_tokens_and_identity_give_the_same_digest():
    tokens = list(range(8))
    assert chain(tokens, BS, ID) == chain(np.array(tokens, dtype=np.int64), BS, ID)
    first, second = chain(tokens, BS, ID)
    assert len(first) == 32 and second == block_digest(first, tokens[4:], ID)
    assert 0 <= external_hash(second) < 2**64


def test_model_dtype_block_size_and_layout_change_the_digest():
    tokens = list(range(4))
    base = block_digest(None, tokens, ID)
    for other in (identity_key("other:LlamaForCausalLM", "float32", "float32", BS, "tp1"),
                  identity_key("tiny:LlamaForCausalLM", "float16", "float16", BS, "tp1"),
                  identity_key("tiny:LlamaForCausalLM", "float32", "bfloat16", BS, "tp1"),
                  identity_key("tiny:LlamaForCausalLM", "float32", "float32", 8, "tp1"),
                  identity_key("tiny:LlamaForCausalLM", "float32", "float32", BS, "tp2")):
        assert block_digest(None, tokens, other) != base
    # The parent is part of a block's identity: the same tokens after another prefix differ.
    assert block_digest(base, tokens, ID) != base
    assert block_digest(None, [1, 2, 3, 4], ID) != block_digest(None, [1, 2, 3, 5], ID)


def wire(log: KVEventLog) -> list:
    """The log's events as a subscriber decodes them: plain lists."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(log.batch(0)))[1]


def test_radix_cache_logs_stored_chained_and_removed_on_eviction():
    alloc = BlockAllocator(8, BS)
    cache = RadixCache(alloc, BS)
    cache.events = log = KVEventLog(ID, BS)
    prompt = list(range(100, 110))  # 2 full blocks and a tail
    blocks = alloc.allocate(3)
    cache.insert(prompt, blocks)
    longer = prompt[:8] + [7, 7, 7, 7]
    more = blocks[:2] + alloc.allocate(1)
    cache.insert(longer, more)  # only its third block is new
    h = [external_hash(d) for d in chain(longer, BS, ID)]
    assert wire(log) == [
        ["AllBlocksCleared"],
        ["BlockStored", h[:2], None, prompt[:8], BS, None, "GPU", None],
        ["BlockStored", [h[2]], h[1], [7, 7, 7, 7], BS, None, "GPU", None],
    ]
    alloc.free(blocks + more[2:])
    assert cache.evict(3) == 3
    events = wire(log)
    assert events[0][0] == "BlockRemoved" and sorted(events[0][1]) == sorted(h)
    assert [e[-1] for e in events] == ["GPU"]


def test_an_adapters_blocks_are_published_with_their_tokens_as_sent_and_its_name():
    """The cache files a LoRA request's tokens salted above 2^32 (kv_manager.cache_tokens); its
    events carry the plain ids, lora_id (the salt) and lora_name, and their own hashes."""
    alloc = BlockAllocator(8, BS)
    cache = RadixCache(alloc, BS)
    cache.events = log = KVEventLog(ID, BS)
    log.adapters = {77: "sql"}
    prompt = list(range(100, 108))
    cache.insert(prompt, alloc.allocate(2))
    salted = [t + (77 << 32) for t in prompt]
    cache.insert(salted, alloc.allocate(2))
    base, lora = wire(log)[1:]
    assert base == ["BlockStored", base[1], None, prompt, BS, None, "GPU", None]
    assert lora[2:] == [None, prompt, BS, 77, "GPU", "sql"]
    assert set(lora[1]).isdisjoint(base[1])  # the adapter's blocks are not the base model's


def test_host_tier_logs_its_own_medium():
    alloc = BlockAllocator(4, BS)
    cache = RadixCache(alloc, BS)
    host = HostTier(1, BS)  # one host block: the second save drops the first
    cache.on_evict = host.on_evict
    log = KVEventLog(ID, BS)
    cache.events = log
    host.report_events(log)
    a, b = list(range(4)), list(range(10, 14))
    for tokens in (a, b):
        blocks = alloc.allocate(1)
        cache.insert(tokens, blocks)
        alloc.free(blocks)
        cache.evict(1)
        host.plan_entry()  # the plan is sent: its pins end
    ha, hb = (external_hash(chain(t, BS, ID)[0]) for t in (a, b))
    assert wire(log)[1:] == [
        ["BlockStored", [ha], None, a, BS, None, "GPU", None],
        ["BlockStored", [ha], None, a, BS, None, "CPU", None],
        ["BlockRemoved", [ha], "GPU"],
        ["BlockStored", [hb], None, b, BS, None, "GPU", None],
        ["BlockRemoved", [ha], "CPU"],
        ["BlockStored", [hb], None, b, BS, None, "CPU", None],
        ["BlockRemoved", [hb], "GPU"],
    ]


def test_the_config_is_vllms_json_checked_up_front_and_offset_per_replica():
    import pytest

    from deepinfer.engine.config import EngineConfig, ModelConfigError

    on = ('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
          '"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}')
    assert EngineConfig().kv_events() is None
    assert EngineConfig(kv_events_config='{"enable_kv_cache_events": false}').kv_events() is None
    events = EngineConfig(kv_events_config=on, data_parallel_rank=2).kv_events()
    assert (events.endpoint, events.replay_endpoint, events.topic) == (
        "tcp://*:5559", "tcp://*:5560", "kv-events")
    for bad in ("{", '{"enable_kv_cache_events": true, "typo": 1}', "[]",
                '{"enable_kv_cache_events": true, "publisher": "kafka"}',
                '{"enable_kv_cache_events": true, "endpoint": "tcp://*"}',
                '{"enable_kv_cache_events": true, "buffer_steps": 0}'):
        with pytest.raises(ModelConfigError, match="--kv-events-config"):
            EngineConfig(kv_events_config=bad)


def test_the_events_endpoint_binds_loopback_unless_told_otherwise():
    """The events carry every cached prompt's token ids: not on every interface by default."""
    from deepinfer.engine.config import EngineConfig

    events = EngineConfig(kv_events_config='{"enable_kv_cache_events": true}').kv_events()
    assert events.endpoint == "tcp://127.0.0.1:5557"


def test_the_event_stream_always_describes_the_caches_exactly():
    """A scheduler under eviction pressure with a host tier: replaying its events gives the
    device cache's and the host tier's blocks, no more, no less."""
    import random

    from deepinfer.engine.kvcache.block_hash import external_hash as ext
    from deepinfer.engine.protocol import SamplingParams, StepResult, TokenizedRequest, pack_ids
    from deepinfer.engine.scheduler.scheduler import Scheduler, SchedulerConfig

    s = Scheduler(SchedulerConfig(num_blocks=24, block_size=BS, max_num_seqs=4,
                                  max_num_batched_tokens=64, context_len=96, host_blocks=6,
                                  kv_events_identity=ID))
    rng = random.Random(0)
    prefixes = [[rng.randrange(1000) for _ in range(12)] for _ in range(3)]
    held: dict[str, set[int]] = {"GPU": set(), "CPU": set()}
    for i in range(40):
        prompt = rng.choice(prefixes)[: rng.randrange(4, 13)] + [rng.randrange(1000)
                                                                 for _ in range(rng.randrange(9))]
        s.add(TokenizedRequest(f"r{i}", pack_ids(prompt), SamplingParams(
            max_tokens=rng.randrange(1, 6), ignore_eos=True)))
        for _ in range(rng.randrange(1, 4)):
            plan = s.schedule()
            if plan is not None:
                n = sum(seq.sample for _, seq in plan.scheduled)
                s.update(plan, StepResult(plan.plan.step_id, pack_ids([7] * n)))
        for event in msgspec.msgpack.decode(msgspec.msgpack.encode(s.kv_events.take())):
            if event[0] == "AllBlocksCleared":
                held = {"GPU": set(), "CPU": set()}
            elif event[0] == "BlockStored":
                assert event[4] == BS and len(event[3]) == BS * len(event[1])
                held[event[6]] |= set(event[1])
            else:
                assert set(event[1]) <= held[event[2]]  # only what was stored is removed
                held[event[2]] -= set(event[1])
        tree = [b for n in s.kv.cache._nodes() for b in n.blocks]
        assert held["GPU"] == {ext(s.kv_events.digest(b)[0]) for b in tree}
        assert len(held["CPU"]) == s.connectors[0].num_used
    assert s.kv.cache.evictions > 0 and s.connectors[0].blocks_saved > 0


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """A consumer's structs shaped as vLLM declares its events, written from the published
    field order (not imported)."""


class _Stored(_Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class _Removed(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class _Cleared(_Event, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    data_parallel_rank: int | None = None


def test_a_consumer_with_vllms_typed_structs_decodes_our_batches():
    log = KVEventLog(ID, BS)
    log.stored(None, list(range(8)), [0, 1])
    log.removed(1)
    batch = msgspec.msgpack.decode(msgspec.msgpack.encode(log.batch(3)), type=_Batch)
    first, second = chain(list(range(8)), BS, ID)
    assert batch.data_parallel_rank == 3 and batch.events == [
        _Cleared(),
        _Stored([external_hash(first), external_hash(second)], None, list(range(8)), BS, None,
                "GPU"),
        _Removed([external_hash(second)], "GPU")]
