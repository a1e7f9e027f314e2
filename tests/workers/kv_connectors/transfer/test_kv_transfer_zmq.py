"""The KV-transfer threads (workers/kv_connectors/transfer/) on their own: a real KVSender and
KVPuller over ZeroMQ tcp with small CPU caches, PULL sockets standing in for the two schedulers
(the sender learns of holds as a plan would tell it, `KVSender.hold`).

`Link` is shared with test_kv_transfer_nixl.py beside this file (the same checks, NIXL moving
the blocks)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgspec
import pytest
import torch
import zmq

from deepinfer.engine import config as engine_config
from deepinfer.engine.config import EngineConfig, ModelConfigError
from deepinfer.engine.kv_transfer_wire import (
    Read,
    ReadReply,
    seal_request,
    split_address,
)
from deepinfer.engine.protocol import KVHold, KVPull, KVTransferDone, pack_ids
from deepinfer.engine.runtime.ipc import pull as bind_pull
from deepinfer.workers.kv_connectors.transfer.puller import MAX_CONCURRENT_PULLS, KVPuller
from deepinfer.workers.kv_connectors.transfer.sender import KVSender, max_request_bytes

SECRET = b"test-cluster-secret"

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
    `pulled` (the schedulers' sockets). `Link.close_all` after each test (conftest.py)."""

    opened: list[Link] = []

    def __init__(self, backend: str = "zmq", timeout: float = 10.0,
                 src: list[list[torch.Tensor]] | None = None,
                 dst: list[list[torch.Tensor]] | None = None,
                 puller_secret: bytes = SECRET) -> None:
        self.zctx = zmq.Context()
        tag = uuid.uuid4().hex
        self.sent = bind_pull(self.zctx, f"inproc://sent-{tag}")
        self.pulled = bind_pull(self.zctx, f"inproc://pulled-{tag}")
        self.src = make_caches(1) if src is None else src
        self.dst = make_caches(None) if dst is None else dst
        self.sender = KVSender(self.zctx, self.src, "127.0.0.1", 0, f"inproc://sent-{tag}",
                               SECRET, backend=backend)
        self.puller = KVPuller(self.zctx, self.dst, 0, f"inproc://pulled-{tag}", timeout,
                               puller_secret, backend=backend)
        self.sender.start()
        Link.opened.append(self)

    @classmethod
    def close_all(cls) -> None:
        """Drop every NIXL agent made so far (each one's progress thread spins a core)."""
        for link in cls.opened:
            for side in (link.sender, link.puller):
                if side.nixl is not None:
                    side.nixl.close()
        cls.opened.clear()

    def hold(self, transfer_id: str, blocks: list[list[int]]) -> None:
        """The prefill scheduler holds these blocks (per group) for `transfer_id`."""
        self.sender.hold([KVHold(transfer_id, [pack_ids(g) for g in blocks])])

    def pull(self, transfer_id: str, pairs: list[list[tuple[int, int]]],
             address: str | None = None, request_id: str | None = None,
             held: bool = True) -> KVPull:
        """Start pulling (remote block, local block) pairs per group; the sender holds the
        remote ones for the transfer first, unless `held` is False."""
        if held:
            self.hold(transfer_id, [[r for r, _ in g] for g in pairs])
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
    link.hold("gone", [[3, 7, 0], [11, 4], []])
    link.sender.release(["gone"])
    link.pull("gone", PAIRS, held=False)
    done = link.report(link.pulled)
    assert "released" in done.error
    link.check_copied([[], [], []])  # nothing written


def test_a_pulled_transfer_is_refused_as_soon_as_it_is_released(link):
    """The decode side's Release ends the transfer on the prefill rank at once: a replayed
    pull of it was served until the scheduler's next plan, which an idle server may not send
    for a long time."""
    link.pull("t5", PAIRS)
    assert link.report(link.pulled).error is None
    assert link.report(link.sent).transfer_id == "t5"  # the Release was handled
    link.pull("t5", PAIRS, held=False)
    assert "released" in (link.report(link.pulled).error or "")


def test_an_oversize_message_is_dropped_with_its_connection_unread(link):
    """Anyone who reaches a transfer socket may send to it, and a message's MAC is checked only
    once it is whole: one larger than the largest read a decode rank can ask for (every block
    of every group) is dropped with its connection as its size arrives, never buffered (512
    MiB had taken a worker from 288 to 1312 MiB). The sender serves on."""
    from zmq.utils.monitor import recv_monitor_message

    sock = link.zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    endpoint, _ = split_address(link.sender.address)
    sock.connect(endpoint)
    sock.send_multipart([b"\0" * (max_request_bytes(link.src) + 1), b"\0" * 32])
    deadline = time.monotonic() + 10
    while not monitor.poll(50):
        assert not sock.poll(0), "the sender read the message and answered it"
        assert time.monotonic() < deadline, "the sender kept the connection"
    assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
    sock.disable_monitor()
    sock.close(0)
    every = [[(b, b) for b in range(NUM_BLOCKS)]] * 2 + [[]]
    link.pull("t6", every)  # the largest legitimate read passes
    assert link.report(link.pulled).error is None
    link.check_copied(every)


def test_restarted_sender_is_refused(link):
    endpoint = link.sender.address.partition("#")[0]
    link.pull("t3", PAIRS, address=f"{endpoint}#oldnonce")
    assert "restarted" in link.report(link.pulled).error


def test_blocks_outside_the_transfer_are_refused(link):
    """A read of a transfer held now, but of blocks it does not hold (another request's, or
    past the cache): nothing is sent."""
    link.hold("t4", [[3, 7], [11], []])
    for pairs in ([[(3, 0), (8, 1)], [], []], [[(NUM_BLOCKS, 0)], [], []],
                  [[(3, 0)], [(2**31 - 1, 1)], []]):
        link.pull("t4", pairs, held=False)
        assert "not the transfer's own" in link.report(link.pulled).error
    link.check_copied([[], [], []])


def test_a_transfer_held_elsewhere_is_not_served_to_another_transfer(link):
    """Holding one transfer does not open another's blocks: a read names its transfer, and
    gets only what that one holds."""
    link.hold("mine", [[3], [], []])
    link.hold("theirs", [[7], [], []])
    link.pull("mine", [[(7, 0)], [], []], held=False)
    assert "not the transfer's own" in link.report(link.pulled).error
    link.check_copied([[], [], []])


def test_a_pull_waits_for_a_hold_on_its_way(link):
    """The decode side may ask before the prefill rank's plan told it of the hold: it asks
    again until the hold arrives."""
    link.pull("late", PAIRS, held=False)
    time.sleep(0.3)
    assert not link.pulled.poll(0)  # still asking
    link.hold("late", [[r for r, _ in g] for g in PAIRS])
    assert link.report(link.pulled).error is None
    link.check_copied(PAIRS)


def test_a_transfer_never_held_fails_at_the_deadline():
    link = Link(timeout=0.5)
    link.pull("never", PAIRS, held=False)
    assert "not held" in link.report(link.pulled).error
    link.check_copied([[], [], []])


def test_unauthenticated_requests_get_nothing(link):
    """A peer without the cluster secret, even with the sender's nonce from its address and a
    held transfer's id, reads no block and releases nothing."""
    link.hold("t9", [[3, 7], [11], []])
    endpoint, nonce = split_address(link.sender.address)
    sock = link.zctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    read = msgspec.msgpack.encode(Read(1, nonce, "t9", [pack_ids([3]), pack_ids([]),
                                                      pack_ids([])]))
    for frames in ([read], [read, b"\0" * 32], seal_request(b"another-secret", nonce, read)):
        sock.send_multipart(frames)
        assert sock.poll(5000)
        reply, *rest = sock.recv_multipart()
        answer = msgspec.msgpack.decode(reply, type=ReadReply)
        assert "unauthenticated" in answer.error and rest == [b""]  # no blocks
    assert not link.sent.poll(200)  # and no Release reached the scheduler


def test_a_puller_with_another_secret_fails_clearly():
    link = Link(puller_secret=b"another-secret")
    link.pull("t10", PAIRS)
    assert "unauthenticated" in link.report(link.pulled).error
    link.check_copied([[], [], []])


def test_a_dead_prefill_server_does_not_hold_up_other_pulls():
    """Pulls from an address that never answers wait out their deadline while a pull from a
    live server goes through at once."""
    link = Link(timeout=30)
    dead = f"{free_endpoint()}#nonce"
    for i in range(MAX_CONCURRENT_PULLS - 1):
        link.pull(f"dead{i}", PAIRS, address=dead)
    link.pull("alive", PAIRS)
    done = link.report(link.pulled, timeout=10)
    assert (done.transfer_id, done.error) == ("alive", None)
    link.check_copied(PAIRS)
    link.puller.cancel([f"dead{i}" for i in range(MAX_CONCURRENT_PULLS - 1)])


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


def test_an_abandoning_pull_only_releases_the_remote_hold(link):
    """A request that ended before its pull was admitted tells the prefill side to free its
    hold, and copies nothing."""
    link.hold("t11", [[3, 7, 0], [11, 4], []])
    link.puller.submit([KVPull("r11", "t11", [link.sender.address], [], abandon=True)])
    done = link.report(link.pulled)
    assert done.transfer_id == "r11" and done.cancelled
    sent = link.report(link.sent)
    assert sent.transfer_id == "t11" and sent.cancelled
    link.check_copied([[], [], []])


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
    from deepinfer.workers.kv_connectors.transfer import nixl_transport

    assert "nixl" not in nixl_transport.__dict__


def test_a_pull_waiting_on_a_dead_server_does_not_hold_up_the_process_exit(tmp_path):
    """The pulling threads are daemons: a worker that exits (or a test process) does not wait
    out a pull's deadline, nor for a scheduler that no longer reads its reports."""
    script = tmp_path / "exit.py"
    script.write_text(
        "import sys, zmq\n"
        "sys.path.append(sys.argv[1])\n"
        "from tests.workers.kv_connectors.transfer.test_kv_transfer_zmq import (\n"
        "    PAIRS, Link, free_endpoint)\n"
        "link = Link(timeout=300)\n"
        "link.pull('t', PAIRS, address=free_endpoint() + '#n')\n"
        "link.pulled.close(0)  # nobody will read the report\n"
        "print('leaving')\n")
    repo = str(Path(__file__).resolve().parents[4])
    out = subprocess.run([sys.executable, str(script), repo], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "leaving" in out.stdout, out.stderr
