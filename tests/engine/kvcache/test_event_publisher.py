"""The KV event publisher's wire protocol, read by plain zmq sockets (not our classes)."""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
import zmq

from deepinfer.engine.config import KVEventsConfig
from deepinfer.engine.kvcache.event_publisher import EventPublisherError, ZmqEventPublisher
from deepinfer.engine.kvcache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

END = (-1).to_bytes(8, "big", signed=True)


def replay(ctx: zmq.Context, endpoint: str, first: int) -> list[tuple[int, bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", first.to_bytes(8, "big")])
    out = []
    try:
        while True:
            assert dealer.poll(5000), "no replay answer"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(0)


def test_batches_reach_a_subscriber_and_replay_returns_missed_ones(tmp_path):
    pub_addr, replay_addr = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay"
    publisher = ZmqEventPublisher(KVEventsConfig(
        enable_kv_cache_events=True, endpoint=pub_addr, replay_endpoint=replay_addr,
        topic="kv-events", buffer_steps=3))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sub.connect(pub_addr)
    try:
        publisher.publish(KVEventBatch(1.5, [AllBlocksCleared()], 0))
        # The first batch went out before the subscription settled: replay brings it back.
        deadline = time.monotonic() + 10
        while not (got := replay(ctx, replay_addr, 0)) and time.monotonic() < deadline:
            pass
        assert [s for s, _ in got] == [0]
        assert msgspec.msgpack.decode(got[0][1]) == [1.5, [["AllBlocksCleared"]], 0]
        # The subscription is live once a probe batch arrives (a slow joiner misses some).
        seq, deadline = 1, time.monotonic() + 10
        while True:
            publisher.publish(KVEventBatch(2.0, [BlockRemoved([seq], "GPU")], 0))
            if sub.poll(100):
                break
            seq += 1
            assert time.monotonic() < deadline
        topic, seq_bytes, payload = sub.recv_multipart()
        assert topic == b"kv-events" and len(seq_bytes) == 8
        first_live = int.from_bytes(seq_bytes, "big")
        publisher.publish(KVEventBatch(3.0, [BlockStored(
            [2**64 - 1, 7], None, list(range(8)), 4, None, "GPU")], None))
        while True:
            _, seq_bytes, payload = sub.recv_multipart()
            if msgspec.msgpack.decode(payload)[0] == 3.0:
                break
        last = int.from_bytes(seq_bytes, "big")
        assert msgspec.msgpack.decode(payload) == [
            3.0, [["BlockStored", [2**64 - 1, 7], None, list(range(8)), 4, None, "GPU", None]],
            None]
        # A bounded buffer: only the last 3 batches are kept.
        kept = replay(ctx, replay_addr, 0)
        assert [s for s, _ in kept] == list(range(last - 2, last + 1))
        assert kept[-1][1] == payload and last > first_live
    finally:
        sub.close(0)
        ctx.term()
        publisher.close()


def test_a_taken_port_is_a_clear_start_up_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(EventPublisherError, match="--kv-events-config: cannot bind"):
            ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint))


def test_an_oversized_replay_request_cuts_its_sender_off(tmp_path):
    """A replay request is 8 bytes: a peer sending more is dropped by ZeroMQ before the message
    is buffered (256 MiB sent to the socket had raised the scheduler's memory by 512 MiB)."""
    from zmq.utils.monitor import recv_monitor_message

    replay_addr = f"ipc://{tmp_path}/replay"
    publisher = ZmqEventPublisher(KVEventsConfig(
        enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/ev",
        replay_endpoint=replay_addr))
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    monitor = dealer.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    try:
        dealer.connect(replay_addr)
        events = []
        while zmq.EVENT_CONNECTED not in events:
            assert monitor.poll(10_000), "never connected"
            events.append(recv_monitor_message(monitor)["event"])
        dealer.send_multipart([b"", b"x" * 4096])
        while zmq.EVENT_DISCONNECTED not in events:
            assert monitor.poll(10_000), "the oversized request was taken"
            events.append(recv_monitor_message(monitor)["event"])
        assert replay(ctx, replay_addr, 0) == []  # the publisher serves on
    finally:
        dealer.disable_monitor()
        monitor.close(0)
        dealer.close(0)
        ctx.term()
        publisher.close()
