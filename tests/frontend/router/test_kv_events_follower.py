"""The router's event follower (frontend/router/kv_events.py) against a real publisher
(engine/kvcache/event_publisher.py) or a raw PUB socket: it notices a replica that restarted,
and nothing a replica sends stops it following."""

from __future__ import annotations

import asyncio
import time
from collections import deque

import msgspec
import zmq

from deepinfer.engine.config import KVEventsConfig
from deepinfer.engine.kvcache.event_publisher import REPLAYS_PER_WAKE, ZmqEventPublisher
from deepinfer.engine.kvcache.kv_events import AllBlocksCleared, BlockStored, KVEventBatch
from deepinfer.frontend.router.block_index import BlockIndex
from deepinfer.frontend.router.kv_events import EventFollower, EventSource

BS = 4
REPLICA = "http://replica"


def stored(h: int) -> BlockStored:
    return BlockStored([h], None, [h] * BS, BS, None, "GPU")


def held(index: BlockIndex) -> set[int]:
    return set(index._blocks.get(REPLICA, {}))


async def until(check, what: str, publish=None) -> None:
    """Poll `check` (publishing one more batch each time, if asked) up to a deadline."""
    deadline = time.monotonic() + 20
    while not check():
        assert time.monotonic() < deadline, what
        if publish is not None:
            publish()
        await asyncio.sleep(0.02)


def test_a_restarted_replica_is_followed_from_its_new_stream(tmp_path):
    """The new stream's first batches (AllBlocksCleared among them) go out before the router's
    subscription reconnects; what it then sees are numbers it saw from the old stream."""
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/ev",
                            replay_endpoint=f"ipc://{tmp_path}/replay")
    index = BlockIndex()
    follower = EventFollower([EventSource(REPLICA, config.endpoint, config.replay_endpoint)],
                             index)

    async def main() -> None:
        task = asyncio.create_task(follower.run())
        old = ZmqEventPublisher(config)
        try:
            old.publish(KVEventBatch(0.0, [AllBlocksCleared()]))
            for h in range(1, 301):  # seq 0..300
                old.publish(KVEventBatch(0.0, [stored(h)]))
            await until(lambda: held(index) == set(range(1, 301)), "the old stream")
        finally:
            old.close()
        new = ZmqEventPublisher(config)
        try:
            new.publish(KVEventBatch(0.0, [AllBlocksCleared()]))
            count = iter(range(1000, 1290))  # numbered below the old stream's last

            def publish() -> None:
                h = next(count, None)
                assert h is not None, "the new stream was never followed"
                new.publish(KVEventBatch(0.0, [stored(h)]))

            await until(lambda: held(index) and held(index) <= set(range(1000, 1290)),
                        "the new stream replaced the old one", publish)
        finally:
            new.close()
            task.cancel()

    asyncio.run(main())


def test_malformed_messages_and_batches_are_skipped(tmp_path):
    endpoint = f"ipc://{tmp_path}/raw"
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(endpoint)
    index = BlockIndex()
    follower = EventFollower([EventSource(REPLICA, endpoint, None)], index)
    seqs = iter(range(10**6))

    def send(payload: bytes) -> None:
        pub.send_multipart([b"", next(seqs).to_bytes(8, "big"), payload])

    def publish() -> None:
        pub.send_multipart([b"", b"two frames"])
        send(b"\xc1 not msgpack")
        send(msgspec.msgpack.encode([0.0, [["BlockStored", "x", None, 5, BS]], None]))
        send(msgspec.msgpack.encode(KVEventBatch(0.0, [stored(next(seqs))])))

    async def main() -> None:
        task = asyncio.create_task(follower.run())
        try:
            # Two good batches, each after bad ones: the follower lived past the bad ones.
            await until(lambda: len(held(index)) >= 2, "still following", publish)
            assert not task.done()
        finally:
            task.cancel()

    try:
        asyncio.run(main())
    finally:
        pub.close(0)
        ctx.term()


def test_a_replay_flood_waits_its_turn_behind_new_batches():
    """Each wake-up of the publisher's thread answers a few replay requests, then publishes
    what is queued: a client sending requests without end cannot starve the stream."""
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind("inproc://replay-flood")
    dealer.connect("inproc://replay-flood")
    try:
        for _ in range(3 * REPLAYS_PER_WAKE):
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert router.poll(5000)
        ZmqEventPublisher._serve_replay(router, deque([(0, b"batch")]))
        answers = 0
        while dealer.poll(0):
            _, seq, _ = dealer.recv_multipart()
            answers += seq == (-1).to_bytes(8, "big", signed=True)
        assert answers == REPLAYS_PER_WAKE
    finally:
        router.close(0)
        dealer.close(0)
        ctx.term()
