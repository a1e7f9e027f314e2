"""NIXL as the bulk transport of a KV transfer (`--kv-transfer-backend nixl`; needs
`pip install 'deepinfer[nixl]'`): each rank's transfer thread owns a NIXL agent (UCX backend)
with its cache tensors registered, and a decode rank READs a prefill rank's blocks straight into
its own ones (RDMA or CUDA IPC where the hardware has them, shared memory or TCP otherwise), one
descriptor per tensor and run of blocks consecutive on both sides (per block, each descriptor
costs the transport a copy of its own). The control messages stay on the ZeroMQ sockets
(engine/kv_transfer_wire.py).

Both sides derive their cache layout from the same model and spec (wire.group_tensors), so a
remote block's address is its tensor's base address + block * block bytes. nixl is imported
here only, when an agent is made.
"""

from __future__ import annotations

import importlib
import time

import msgspec
import numpy as np
import torch

# `nixl` picks the build matching torch's CUDA; nixl-cu12 alone (the extra) has no `nixl`.
_NIXL_MODULES = ("nixl", "nixl_cu12._api", "nixl_cu13._api")


class NixlMeta(msgspec.Struct, array_like=True):
    """A prefill rank's answer to Meta (engine/kv_transfer_wire.py): what a reader needs to
    read its blocks."""

    agent: bytes  # NIXL agent metadata (for add_remote_agent)
    mem: str  # "DRAM" or "VRAM"
    device: int
    bases: list[list[int]]  # per KV group, each cache tensor's address
    block_bytes: list[list[int]]


def _make_agent(name: str):
    for module in _NIXL_MODULES:
        try:
            api = importlib.import_module(module)
        except ImportError:
            continue
        return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
    raise ImportError("--kv-transfer-backend nixl needs NIXL: pip install 'deepinfer[nixl]'")


class _Agent:
    """A NIXL agent with one rank's cache tensors registered."""

    def __init__(self, tensors: list[list[torch.Tensor]], name: str) -> None:
        flat = [t for ts in tensors for t in ts]
        if any(not t.is_contiguous() for t in flat):
            raise ValueError("NIXL reads blocks by address: the KV cache must be contiguous")
        self.agent = _make_agent(name)
        if flat:
            self.agent.register_memory(flat)
        self.mem = "VRAM" if flat and flat[0].is_cuda else "DRAM"
        self.device = max(flat[0].get_device(), 0) if flat else 0
        self.bases = [[t.data_ptr() for t in ts] for ts in tensors]
        self.block_bytes = [[t[0].numel() * t.element_size() for t in ts] for ts in tensors]

    def close(self) -> None:
        """Drop the agent: its progress thread spins a core for as long as it lives."""
        self.agent = None


class NixlSource(_Agent):
    """Prefill side: nothing to do per transfer, the readers' NIXL READs need only `meta`."""

    def __init__(self, tensors: list[list[torch.Tensor]], name: str) -> None:
        super().__init__(tensors, name)
        self.meta = msgspec.msgpack.encode(NixlMeta(
            self.agent.get_agent_metadata(), self.mem, self.device, self.bases,
            self.block_bytes))


class NixlRead:
    """One posted NIXL READ; `close` it in every case (a READ still under way is cancelled)."""

    def __init__(self, agent, handle, nbytes: int) -> None:
        self.agent, self.handle, self.nbytes = agent, handle, nbytes

    def done(self) -> bool:
        state = self.agent.check_xfer_state(self.handle)
        if state == "ERR":
            raise RuntimeError("the NIXL read failed")
        return state == "DONE"

    def close(self) -> None:
        try:
            self.agent.release_xfer_handle(self.handle)  # cancels one under way, if it can
            return
        except Exception:
            pass
        while self.agent.check_xfer_state(self.handle) == "PROC":  # it still writes our blocks
            time.sleep(0.01)
        self.agent.release_xfer_handle(self.handle)


class NixlSink(_Agent):
    """Decode side: knows each prefill rank it has read from and reads blocks from it."""

    def __init__(self, tensors: list[list[torch.Tensor]], name: str) -> None:
        super().__init__(tensors, name)
        self.peers: dict[str, tuple[str, str, NixlMeta]] = {}  # endpoint -> (nonce, agent, meta)

    def knows(self, endpoint: str, nonce: str) -> bool:
        peer = self.peers.get(endpoint)
        return peer is not None and peer[0] == nonce

    def add_peer(self, endpoint: str, nonce: str, data: bytes) -> None:
        meta = msgspec.msgpack.decode(data, type=NixlMeta)
        if meta.block_bytes != self.block_bytes:
            raise ValueError("the prefill server's KV cache has another layout (a different "
                             "model, dtype or tensor-parallel size?)")
        old = self.peers.pop(endpoint, None)
        if old is not None:  # that server restarted: its old agent is gone
            self.agent.remove_remote_agent(old[1])
        self.peers[endpoint] = (nonce, self.agent.add_remote_agent(meta.agent), meta)

    def read(self, endpoint: str, pairs: list[np.ndarray]) -> NixlRead | None:
        """Post the READ of (remote block, local block) pairs per group; None: nothing to
        read."""
        _, name, meta = self.peers[endpoint]
        local, remote = [], []
        for g, p in enumerate(pairs):
            if not len(p):
                continue
            first_remote, first_local, count = _runs(p)
            for ours, theirs, size in zip(self.bases[g], meta.bases[g], self.block_bytes[g]):
                local.append(_descs(ours, first_local, count, size, self.device))
                remote.append(_descs(theirs, first_remote, count, size, meta.device))
        if not local:
            return None
        local_descs = np.concatenate(local)
        handle = self.agent.initialize_xfer(
            "READ", self.agent.get_xfer_descs(local_descs, self.mem),
            self.agent.get_xfer_descs(np.concatenate(remote), meta.mem), name)
        read = NixlRead(self.agent, handle, int(local_descs[:, 1].sum()))
        if self.agent.transfer(handle) == "ERR":
            read.close()
            raise RuntimeError("the NIXL read could not be posted")
        return read


def _runs(pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(remote block, local block) pairs -> (first remote, first local, length) of each run
    that steps by one block on both sides."""
    breaks = np.flatnonzero((np.diff(pairs[:, 0]) != 1) | (np.diff(pairs[:, 1]) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    return pairs[starts, 0], pairs[starts, 1], np.diff(np.append(starts, len(pairs)))


def _descs(base: int, first: np.ndarray, count: np.ndarray, size: int,
           device: int) -> np.ndarray:
    """NIXL's Nx3 descriptor rows (address, bytes, device) for runs of blocks of a tensor."""
    out = np.empty((len(first), 3), dtype=np.uint64)
    out[:, 0] = base + first.astype(np.uint64) * np.uint64(size)
    out[:, 1] = count.astype(np.uint64) * np.uint64(size)
    out[:, 2] = device
    return out
