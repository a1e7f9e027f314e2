"""Parallel state of this worker: its rank, the world size and the torch.distributed group the
ranks share (gloo on CPU, NCCL on CUDA).

The launcher starts one worker per rank and hands each its rank and the group's rendezvous
(a file in the engine's private socket directory on one host, TCP across hosts). Model layers
read `tp()` (dense layers' shards) and `ep()` (experts' shards) when they are built, to size and
load only their part; both are rank 0 of 1 when nothing was set up, so single-worker code never
branches on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelState:
    rank: int = 0
    world: int = 1

    def shard(self, size: int, what: str = "dimension") -> tuple[int, int]:
        """(start, size) of this rank's equal part of `size`."""
        if size % self.world:
            raise ValueError(f"{what} ({size}) does not split over {self.world} ranks")
        part = size // self.world
        return self.rank * part, part

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first, count) of the KV heads this rank keeps: as even a split as the count allows
        (the first ranks take one more), or, with fewer KV heads than ranks, the one head its
        query heads read (replicated)."""
        if num_kv_heads < self.world:
            return self.rank * num_kv_heads // self.world, 1
        base, extra = divmod(num_kv_heads, self.world)
        return self.rank * base + min(self.rank, extra), base + (self.rank < extra)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world > 1:
            dist.broadcast(x, src)
        return x

    def broadcast_lists(self, lists: list[list[int]], count: int,
                        device: torch.device) -> list[list[int]]:
        """Rank 0's `count` int lists on every rank (other ranks pass anything): their lengths
        then their items in one tensor, after its size (NCCL moves device tensors only)."""
        if self.world == 1:
            return lists
        if self.rank == 0:
            data = torch.tensor([len(x) for x in lists] + [i for x in lists for i in x],
                                dtype=torch.int64, device=device)
            size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=device)
        self.broadcast(size)
        if self.rank == 0:
            self.broadcast(data)
            return lists
        flat = self.broadcast(torch.empty(int(size), dtype=torch.int64, device=device)).tolist()
        out, pos = [], count
        for n in flat[:count]:
            out.append(flat[pos: pos + n])
            pos += n
        return out


_ONE = ParallelState()
_GROUP = _ONE
_EXPERT_PARALLEL = False


def group() -> ParallelState:
    """Every worker rank: who samples (rank 0) and who hears of it."""
    return _GROUP


def tp() -> ParallelState:
    """How dense layers (attention, MLPs, vocabulary) split: over every rank with tensor
    parallelism; not at all with expert parallelism, where they are replicated."""
    return _ONE if _EXPERT_PARALLEL else _GROUP


def ep() -> ParallelState:
    """How a layer's experts split, whole, over the ranks (expert parallelism)."""
    return _GROUP if _EXPERT_PARALLEL else _ONE


def init_tensor_parallel(rank: int, world: int, init_method: str,
                         expert_parallel: bool = False,
                         device: torch.device | None = None) -> ParallelState:
    """Join the workers' group (once per process): NCCL between GPU ranks, gloo between CPU
    ones."""
    global _GROUP, _EXPERT_PARALLEL
    if world > 1:
        backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    _GROUP = ParallelState(rank, world)
    _EXPERT_PARALLEL = expert_parallel and world > 1
    return _GROUP
