"""The engine's inbound sockets bound the size of a message: a peer announcing more is cut off
before anything is buffered, and the socket goes on taking other peers' messages."""

from __future__ import annotations

import time

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from deepinfer.engine.runtime import ipc
from deepinfer.engine.runtime.ipc import (
    MAX_MESSAGE_BYTES,
    plan_receiver,
    plan_sender,
    pull,
    push,
)


def wait_for_event(monitor: zmq.Socket, event: int, deadline_s: float = 30.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if monitor.poll(200) and recv_monitor_message(monitor)["event"] == event:
            return
    raise AssertionError(f"no event {event} within {deadline_s} s")


def test_a_message_over_the_bound_cuts_its_sender_off(tmp_path):
    ctx = zmq.Context()
    try:
        inbound = pull(ctx, f"ipc://{tmp_path}/in", max_bytes=1 << 16)
        monitor = inbound.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        big = push(ctx, f"ipc://{tmp_path}/in")
        big.send(b"x" * (1 << 20))
        wait_for_event(monitor, zmq.EVENT_DISCONNECTED)  # dropped as announced, unread
        small = push(ctx, f"ipc://{tmp_path}/in")
        small.send(b"ok")
        assert inbound.poll(30_000) and inbound.recv() == b"ok"
    finally:
        ctx.destroy(0)


@pytest.mark.parametrize("tcp", [False, True])
def test_every_inbound_engine_socket_is_bounded(tmp_path, tcp):
    """Each process's inbound socket and both ends of the plan sockets (over tcp the scheduler's
    end is bound where other hosts reach it)."""
    ctx = zmq.Context()
    addr = "tcp://127.0.0.1:0" if tcp else f"ipc://{tmp_path}/plans"
    secret = b"s" * 32
    try:
        if tcp:
            with zmq.Context() as probe:  # a free port for the scheduler to bind
                sock = probe.socket(zmq.PULL)
                port = sock.bind_to_random_port("tcp://127.0.0.1")
                sock.close(0)
            addr = f"tcp://127.0.0.1:{port}"
        sender = plan_sender(ctx, addr, secret)
        receiver = plan_receiver(ctx, addr, secret)
        inbound = pull(ctx, f"ipc://{tmp_path}/in")
        for sock in (receiver, inbound) + ((sender,) if tcp else ()):
            assert sock.getsockopt(zmq.MAXMSGSIZE) == MAX_MESSAGE_BYTES
    finally:
        auth = ipc._authenticators.pop(id(ctx), None)  # the CURVE handler (tcp): its socket
        if auth is not None:
            auth.stop()
        ctx.destroy(0)
