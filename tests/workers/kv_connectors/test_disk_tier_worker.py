"""The disk tier's worker half (workers/kv_connectors/disk_tier.py) against real files, real
threads and a real report socket: what a shared directory (or another server in it) can put in
its way never stops its writer or its loader, and its files are its own."""

from __future__ import annotations

import os
import stat
import threading

import msgspec
import pytest
import torch
import zmq

from deepinfer.engine.kv_disk_files import NotABlockFile, block_path, write_block
from deepinfer.engine.kv_identity import identity_key
from deepinfer.engine.kv_layout import FULL, LayerKVLayout
from deepinfer.engine.protocol import DiskWrites, pack_ids
from deepinfer.workers.kv_cache import KVCache
from deepinfer.workers.kv_connectors.disk_tier import DiskTierWorker

BS = 4
ID = identity_key("tiny:LlamaForCausalLM", "float32", "float32", BS, "tp1")


@pytest.fixture
def tier(tmp_path):
    """A stopped worker half (its threads ended): a test runs its writer loop itself, on the
    test's thread, so what it was queued is all it sees."""
    ctx = zmq.Context()
    reports = ctx.socket(zmq.PULL)
    where = f"ipc://{tmp_path}/reports"
    reports.bind(where)
    cache = KVCache([LayerKVLayout(FULL, 1, 2)], num_blocks=4, block_size=BS,
                    dtype=torch.float32)
    for b in range(4):
        cache.pairs[0][0][b].fill_(b)
    worker = DiskTierWorker([cache], str(tmp_path / "kv"), ID, 0, ctx, where)
    worker.close()
    worker.loader.join()
    yield worker, ctx, where, reports
    ctx.destroy(linger=0)  # a writer loop that raised left its socket open


def writes(reports: zmq.Socket) -> DiskWrites:
    """The writer's report of a run_writer (one: everything was queued before it ran)."""
    assert reports.poll(30_000), "no report from the writer"
    return msgspec.msgpack.decode(reports.recv(), type=DiskWrites)


def run_writer(worker: DiskTierWorker, ctx, where: str) -> None:
    worker.writes.put(("stop", b"", None))
    worker._write_loop(ctx, where)


def test_the_same_block_saved_twice_before_it_is_written_is_written_once(tier):
    worker, ctx, where, reports = tier
    name, other = b"\x01" * 32, b"\x02" * 32
    worker._save(pack_ids([1, 1, 2]), name + name + other)  # one plan's saves, queued at once
    run_writer(worker, ctx, where)  # raised TypeError on the second (payload None), once
    done = writes(reports)
    assert done.blocks == 2 and done.failed == b""
    assert block_path(worker.folder, name).is_file() and block_path(worker.folder, other).is_file()
    assert worker.pending == {} and worker.pending_bytes == 0


def test_a_directory_at_a_blocks_path_fails_that_block_alone(tier):
    worker, ctx, where, reports = tier
    blocked, other = b"\x03" * 32, b"\x04" * 32
    block_path(worker.folder, blocked).mkdir(parents=True)
    worker._save(pack_ids([1, 2]), blocked + other)
    run_writer(worker, ctx, where)
    done = writes(reports)
    assert done.failed == blocked  # not a pause of every write (the next one failed too)
    assert done.blocks == 1 and block_path(worker.folder, other).is_file()


def test_block_files_are_readable_by_their_owner_only(tmp_path):
    write_block(tmp_path, b"\x05" * 32, ID, b"x" * 16)
    mode = stat.S_IMODE(block_path(tmp_path, b"\x05" * 32).stat().st_mode)
    assert mode == 0o600


def test_a_fifo_at_a_blocks_path_is_refused_not_waited_on(tier):
    worker, *_ = tier
    name = b"\x06" * 32
    path = block_path(worker.folder, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    outcome: list = []

    def read() -> None:
        try:
            worker._read(name, worker.full.block_bytes)
        except Exception as e:
            outcome.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(60)  # a deadline, not a timing: the read blocked forever before
    assert not reader.is_alive(), "the read waits on the FIFO"
    assert isinstance(outcome[0], NotABlockFile)
    assert path.exists()  # not ours to delete


def test_a_read_that_hangs_is_given_up_after_its_deadline(tier, monkeypatch):
    """A filesystem that never answers: the loader reports a failed read and goes on."""
    import deepinfer.workers.kv_connectors.disk_tier as disk_tier

    worker, *_ = tier
    never = threading.Event()
    monkeypatch.setattr(disk_tier, "READ_DEADLINE", 0.0)
    monkeypatch.setattr(disk_tier, "read_block", lambda *args: never.wait())
    with pytest.raises(TimeoutError):
        worker._read(b"\x07" * 32, worker.full.block_bytes)
    never.set()

