"""The KV-transfer threads with the NIXL backend: a real KVSender and KVPuller, each with its
own NIXL agent (UCX), the decode side READing the prefill side's CPU blocks. Skipped where NIXL
is not installed (pip install 'deepinfer[nixl]')."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from tests.workers.kv_connectors.transfer.test_kv_transfer_zmq import PAIRS, Link, make_caches

# What workers/kv_connectors/transfer/nixl_transport.py loads: the extra installs nixl-cu12
# only, which has no top-level `nixl` module (the `nixl` package adds one over nixl-cu12 and
# nixl-cu13).
pytestmark = [
    pytest.mark.skipif(not any(importlib.util.find_spec(m) for m in ("nixl_cu12", "nixl_cu13")),
                       reason="NIXL is not installed (pip install 'deepinfer[nixl]')"),
    pytest.mark.nixl,
]


@pytest.fixture
def link():
    return Link(backend="nixl")


def test_pull_reads_blocks_bit_exact(link):
    link.pull("t1", PAIRS)
    done = link.report(link.pulled)
    assert (done.transfer_id, done.error, done.cancelled, done.blocks) == ("t1", None, False, 3)
    assert done.bytes == link.block_bytes(PAIRS)
    link.check_copied(PAIRS)
    sent = link.report(link.sent)  # the prefill side heard the Release and what was read
    assert (sent.transfer_id, sent.blocks, sent.cancelled) == ("t1", 3, False)
    assert sent.bytes == link.block_bytes(PAIRS)
    # The agent metadata was asked for once: a second pull from the same rank reuses it.
    link.pull("t2", [[(1, 11)], [(2, 3)], []])
    assert link.report(link.pulled).error is None
    assert len(link.puller.nixl.peers) == 1
    link.check_copied([PAIRS[0] + [(1, 11)], PAIRS[1] + [(2, 3)], []])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_pull_reads_gpu_blocks_bit_exact():
    """VRAM on both sides (UCX: CUDA IPC or copies through the host, whatever it finds)."""
    link = Link(backend="nixl", src=make_caches(1, "cuda"), dst=make_caches(None, "cuda"))
    assert link.sender.nixl.mem == link.puller.nixl.mem == "VRAM"
    link.pull("g1", PAIRS)
    done = link.report(link.pulled)
    assert done.error is None and done.bytes == link.block_bytes(PAIRS)
    link.check_copied(PAIRS)


def test_runs_of_blocks_read_as_one_descriptor(link):
    """Consecutive on both sides: one descriptor per tensor; consecutive on one side only, or
    out of order: separate ones. The copy is the same."""
    from deepinfer.workers.kv_connectors.transfer.nixl_transport import _runs

    pairs = [[(4, 1), (5, 2), (6, 3), (7, 5), (8, 6), (2, 7)], [(9, 0), (10, 1), (11, 2)], []]
    assert [r.tolist() for r in _runs(np.array(pairs[0]))] == [[4, 7, 2], [1, 5, 7], [3, 2, 1]]
    link.pull("runs", pairs)
    done = link.report(link.pulled)
    assert done.error is None and done.bytes == link.block_bytes(pairs)
    link.check_copied(pairs)


def test_group_with_nothing_to_pull(link):
    pairs = [[], [(0, 0), (11, 11)], []]
    link.pull("t3", pairs)
    assert link.report(link.pulled).error is None
    link.check_copied(pairs)


def test_nothing_to_pull_at_all(link):
    link.pull("t4", [[], [], []])
    done = link.report(link.pulled)
    assert done.error is None and done.bytes == 0


def test_released_transfer_is_refused(link):
    link.hold("gone", [[r for r, _ in g] for g in PAIRS])
    link.sender.release(["gone"])
    link.pull("gone", PAIRS, held=False)
    assert "released" in link.report(link.pulled).error
    link.check_copied([[], [], []])


def test_released_during_the_read_fails_the_pull(link, monkeypatch):
    """The hold ran out while the READ was under way: the blocks read may be torn."""
    real_read = link.puller.nixl.read

    def read_then_release(endpoint, pairs):
        out = real_read(endpoint, pairs)
        link.sender.release(["late"])
        return out

    monkeypatch.setattr(link.puller.nixl, "read", read_then_release)
    link.pull("late", PAIRS)
    assert "released" in link.report(link.pulled).error


def test_restarted_sender_is_refused(link):
    endpoint = link.sender.address.partition("#")[0]
    link.pull("t5", PAIRS, address=f"{endpoint}#oldnonce")
    assert "restarted" in link.report(link.pulled).error


def test_zmq_sender_is_named(link):
    """A NIXL decode server pulling from a ZeroMQ prefill server says so."""
    plain = Link(backend="zmq")
    link.pull("t6", PAIRS, address=plain.sender.address)
    assert "--kv-transfer-backend zmq" in link.report(link.pulled).error


def test_zmq_puller_reads_from_nixl_sender():
    """A NIXL prefill server still answers ZeroMQ reads (it has the blocks either way)."""
    link = Link(backend="nixl")
    plain = Link(backend="zmq", src=link.src)
    link.hold("t7", [[r for r, _ in g] for g in PAIRS])
    plain.pull("t7", PAIRS, address=link.sender.address, held=False)
    assert plain.report(plain.pulled).error is None
    plain.check_copied(PAIRS)


def test_other_layout_is_refused():
    src = make_caches(1)
    dst = [[t[:, :2].contiguous() for t in g] for g in make_caches(None)]
    link = Link(backend="nixl", src=src, dst=dst)
    link.pull("t8", PAIRS)
    assert "another layout" in link.report(link.pulled).error
