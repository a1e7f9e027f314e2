"""The KV-transfer threads (workers/kv_transfer/) on their own: a real KVSender and KVPuller
over ZeroMQ tcp with small CPU caches, PULL sockets standing in for the two schedulers.

`Link` is shared with tests/workers/test_kv_transfer_nixl.py (the same checks, NIXL moving
the blocks)."""

from __future__ import annotations

import socket
import time
import uuid

import msgspec
import pytest
import torch
import zmq

from engine import config as engine_config
from engine.config import EngineConfig, ModelConfigError
from engine.protocol import KVPull, KVTransferDone, pack_ids
from engine.runtime.ipc import pull as bind_pull
from workers.kv_transfer.puller import KVPuller
from workers.kv_transfer.sender import KVSender

NUM_BLOCKS = 12
# Per KV group, (block shape, dtype) of each cache tensor: a full group of two layers' K and V,
# a sliding group of other shapes in bfloat16, and a group with no cache tensors.
LAYOUT = [[((4, 8), torch.float32)] * 4,
          [((2, 3, 5), torch.bfloat16), ((2, 3, 5), torch.bfloat16)],
          []]


def make_caches(seed: int | None, device: str = "cpu") -> list[list[torch.Tensor]]:
    """Per group, its tensors: random (seed) or zeros (None)."""
    gen = torch.Generator().manual_seed(seed or 0)
    return [[(torch.randn((NUM_BLOCKS, *shape), generator=gen) if seed is not None
              else torch.zeros(NUM_BLOCKS, *shape)).to(device, dtype) for shape, dtype in group]
            for group in LAYOUT]


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)  # bit for bit (NaN-safe)


def free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class Link:
    """A prefill rank's sender and a decode rank's puller; their reports arrive on `sent` and
    `pulled` (the schedulers' sockets)."""

    def __init__(self, backend: str = "zmq", timeout: float = 10.0,
                 src: list[list[torch.Tensor]] | None = None,
                 dst: list[list[torch.Tensor]] | None = None) -> None:
        self.zctx = zmq.Context()
        tag = uuid.uuid4().hex
        self.sent = bind_pull(self.zctx, f"inproc://sent-{tag}")
        self.pulled = bind_pull(self.zctx, f"inproc://pulled-{tag}")
        self.src = make_caches(1) if src is None else src
        self.dst = make_caches(None) if dst is None else dst
        self.sender = KVSender(self.zctx, self.src, "127.0.0.1", 0, f"inproc://sent-{tag}",
                               backend=backend)
        self.puller = KVPuller(self.zctx, self.dst, 0, f"inproc://pulled-{tag}", timeout,
                               backend=backend)
        self.sender.start()
        self.puller.start()

    def pull(self, transfer_id: str, pairs: list[list[tuple[int, int]]],
             address: str | None = None, request_id: str | None = None) -> KVPull:
        """Start pulling (remote block, local block) pairs per group."""
        job = KVPull(request_id or transfer_id, transfer_id, [address or self.sender.address],
                     [pack_ids([x for pair in g for x in pair]) for g in pairs])
        self.puller.submit([job])
        return job

    @staticmethod
    def report(sock: zmq.Socket, timeout: float = 10.0) -> KVTransferDone:
        assert sock.poll(int(timeout * 1000)), "no report"
        return msgspec.msgpack.decode(sock.recv(), type=KVTransferDone)

    def check_copied(self, pairs: list[list[tuple[int, int]]]) -> None:
        """The pulled blocks equal the source's, bit for bit; every other block is untouched."""
        for src, dst, group in zip(self.src, self.dst, pairs):
            local = {d for _, d in group}
            for s, d in zip(src, dst):
                for r, lb in group:
                    assert torch.equal(raw(d[lb]), raw(s[r]))
                for b in set(range(NUM_BLOCKS)) - local:
                    assert not raw(d[b]).any()

    def block_bytes(self, pairs: list[list[tuple[int, int]]]) -> int:
        return sum(len(g) * t[0].numel() * t.element_size() for ts, g in zip(self.src, pairs)
                   for t in ts)


PAIRS = [[(3, 0), (7, 5), (0, 2)], [(11, 1), (4, 9)], []]


@pytest.fixture
def link():
    return Link()


def test_pull_copies_blocks_bit_exact(link):
    link.pull("t1", PAIRS)
    done = link.report(link.pulled)
    assert (done.transfer_id, done.error, done.cancelled, done.blocks) == ("t1", None, False, 3)
    assert done.bytes == link.block_bytes(PAIRS)
    link.check_copied(PAIRS)
    # The Release reached the prefill side: its scheduler hears the transfer is done.
    sent = link.report(link.sent)
    assert (sent.transfer_id, sent.rank, sent.blocks, sent.cancelled) == ("t1", 0, 3, False)
    assert sent.bytes == link.block_bytes(PAIRS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_pull_copies_gpu_blocks_bit_exact():
    link = Link(src=make_caches(1, "cuda"), dst=make_caches(None, "cuda"))
    link.pull("g1", PAIRS)
    assert link.report(link.pulled).error is None
    link.check_copied(PAIRS)


def test_group_with_nothing_to_pull(link):
    """A group whose blocks the decode server's prefix cache had already (no pairs)."""
    pairs = [[(5, 6)], [], []]
    link.pull("t2", pairs)
    done = link.report(link.pulled)
    assert done.error is None and done.blocks == 1
    link.check_copied(pairs)


def test_released_transfer_is_refused(link):
    link.sender.release(["gone"])
    link.pull("gone", PAIRS)
    done = link.report(link.pulled)
    assert "released" in done.error
    link.check_copied([[], [], []])  # nothing written


def test_restarted_sender_is_refused(link):
    endpoint = link.sender.address.partition("#")[0]
    link.pull("t3", PAIRS, address=f"{endpoint}#oldnonce")
    assert "restarted" in link.report(link.pulled).error


def test_out_of_range_block_is_refused(link):
    link.pull("t4", [[(NUM_BLOCKS, 0)], [], []])
    assert "out of range" in link.report(link.pulled).error


def test_dead_endpoint_times_out():
    link = Link(timeout=0.3)
    t0 = time.monotonic()
    link.pull("t5", PAIRS, address=f"{free_endpoint()}#nonce")
    done = link.report(link.pulled)
    assert "no answer" in done.error and time.monotonic() - t0 < 5
    # The puller still works afterwards (the dead peer's socket was dropped).
    link.pull("t6", PAIRS)
    assert link.report(link.pulled).error is None
    link.check_copied(PAIRS)


def test_cancel_stops_a_pull():
    link = Link(timeout=30)
    link.pull("t7", PAIRS, address=f"{free_endpoint()}#nonce", request_id="r7")
    time.sleep(0.2)  # waiting for an answer that never comes
    t0 = time.monotonic()
    link.puller.cancel(["r7"])
    done = link.report(link.pulled)
    assert done.transfer_id == "r7" and done.cancelled and time.monotonic() - t0 < 5


def test_cancel_before_start_releases_remote(link):
    """A pull whose request ended before it started tells the prefill side it gave up."""
    with link.puller.lock:  # as if submitted earlier and still queued behind another pull
        link.puller.active.add("r8")
    link.puller.cancel(["r8"])
    link.pull("t8", PAIRS, request_id="r8")
    done = link.report(link.pulled)
    assert done.transfer_id == "r8" and done.cancelled
    sent = link.report(link.sent)
    assert sent.transfer_id == "t8" and sent.cancelled
    link.check_copied([[], [], []])


def test_nixl_backend_needs_nixl(monkeypatch):
    monkeypatch.setattr(engine_config, "_NIXL_MODULES", ("no_such_nixl",))
    with pytest.raises(ModelConfigError, match=r"pip install 'deepinfer\[nixl\]'"):
        EngineConfig(kv_transfer_backend="nixl").check_disaggregation()
    with pytest.raises(ModelConfigError, match="--kv-transfer-backend must be one of"):
        EngineConfig(kv_transfer_backend="tcp").check_disaggregation()
    EngineConfig().check_disaggregation()  # zmq, the default, needs nothing


def test_nixl_transport_imports_without_nixl():
    """The module loads nixl only when an agent is made (the core never needs it)."""
    from workers.kv_transfer import nixl_transport

    assert "nixl" not in nixl_transport.__dict__
