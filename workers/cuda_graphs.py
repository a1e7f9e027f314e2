"""Decode-only steps on a GPU replayed from CUDA graphs, one graph per padded batch size.

A decode step launches a few kernels per layer, each too short to hide its launch cost; a graph
replays the whole forward as one launch. Each size B in `sizes` gets static device buffers (token
ids, positions, and per KV group the rows' cache slots, block tables padded to the longest
context, visible key ranges) and a graph of the model's forward over them, captured once at
start. A step of b <= B decode rows copies its values into the smallest size's buffers, padding
the other rows to see no key and write no cache slot, replays, and takes the first b rows.

Graphs take only what keeps the forward free of host work: decode-only steps (no prefill
chunk), a backend and a model class that declare they fit (`supports_cuda_graphs`: the Triton
backend; models whose layers are the Llama family's attention and MLP, as MLA indexes rows from
the host and MoE routing syncs), one rank (no collective inside a graph yet). Anything else runs
eagerly, as does every step under --enforce-eager.

`DecodeGraphs(..., capture=False)` runs the same padded buffers eagerly: what the tests check on
CPU (under the Triton interpreter), where no graph can be captured.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from deepinfer.workers.attention.metadata import AttentionMetadata
from deepinfer.workers.attention.triton_backend import TritonMetadata

log = logging.getLogger("deepinfer.worker")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (at most 256), as decode batches grow."""
    top = min(max_num_seqs, 256)
    sizes = [b for b in (1, 2, 4) if b <= top] + list(range(8, top + 1, 8))
    return sorted(set(sizes + [top]))


class _Buffers:
    """One padded batch size's static inputs, metadata and output."""

    def __init__(self, size: int, groups: int, max_blocks: int, windows: list[int | None],
                 block_size: int, device: torch.device) -> None:
        def zeros(*shape: int, dtype=torch.int64) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.size = size
        self.ids, self.positions = zeros(size), zeros(size)
        self.metas = []
        for g in range(groups):
            meta = TritonMetadata(
                row_slots=zeros(size), decode_rows=torch.arange(size),
                decode_blocks=torch.zeros(size * max_blocks, dtype=torch.int64), prefills=[],
                window=windows[g], decode_lo=torch.zeros(size, dtype=torch.int32),
                decode_hi=torch.zeros(size, dtype=torch.int32), block_size=block_size)
            meta.decode_tables = zeros(size, max_blocks)
            meta.decode_rows_dev = torch.arange(size, device=device)
            meta.decode_lo_dev = zeros(size, dtype=torch.int32)
            meta.decode_hi_dev = zeros(size, dtype=torch.int32)
            self.metas.append(meta)
        self.out: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None

    def fill(self, ids: torch.Tensor, positions: torch.Tensor,
             metas: list[AttentionMetadata]) -> None:
        """This step's b rows first; the rest see no key (lo = hi = 0) and write nothing."""
        b = ids.shape[0]
        self.ids[:b].copy_(ids)
        self.ids[b:].zero_()
        self.positions[:b].copy_(positions)
        self.positions[b:].zero_()
        for mine, meta in zip(self.metas, metas):
            mine.row_slots[:b].copy_(meta.row_slots)
            mine.row_slots[b:].fill_(-1)
            tables = meta.decode_blocks.view(b, -1)
            mine.decode_tables.zero_()
            mine.decode_tables[:b, : tables.shape[1]].copy_(tables)
            mine.decode_lo_dev[:b].copy_(meta.decode_lo)
            mine.decode_lo_dev[b:].zero_()
            mine.decode_hi_dev[:b].copy_(meta.decode_hi)
            mine.decode_hi_dev[b:].zero_()


class DecodeGraphs:
    def __init__(self, model: nn.Module, kv_caches: list, sizes: list[int], max_blocks: int,
                 windows: list[int | None], block_size: int, device: torch.device,
                 capture: bool = True) -> None:
        self.model, self.kv_caches, self.max_blocks = model, kv_caches, max_blocks
        self.buffers = [_Buffers(s, len(windows), max_blocks, windows, block_size, device)
                        for s in sorted(sizes)]
        if capture:
            self._capture()

    @staticmethod
    def supported(model: nn.Module, world: int) -> bool:
        """A model class that declares its forward fits a graph (the Llama family's attention
        and MLP in every layer: workers/models/llama.py), on one rank."""
        return world == 1 and bool(getattr(model, "supports_cuda_graphs", False))

    def _forward(self, buf: _Buffers) -> torch.Tensor:
        return self.model(buf.ids, buf.positions, self.kv_caches, buf.metas)

    def _capture(self) -> None:
        """Largest size first (the shared memory pool then fits every smaller one); each
        forward runs once eagerly before its capture (Triton compiles, allocators settle)."""
        pool = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for buf in reversed(self.buffers):
                for meta in buf.metas:
                    meta.row_slots.fill_(-1)  # no cache slot is written while capturing
                self._forward(buf)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    buf.out = self._forward(buf)
                pool = graph.pool()
                buf.graph = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def run(self, ids: torch.Tensor, positions: torch.Tensor,
            metas: list[AttentionMetadata]) -> torch.Tensor | None:
        """The step's hidden states [b, hidden] from a graph, or None when it does not fit
        one (then the caller runs it eagerly)."""
        b = ids.shape[0]
        if any(m.decode_rows is None or m.prefills or m.decode_rows.shape[0] != b
               for m in metas):
            return None
        if any(m.decode_blocks.shape[0] // b > self.max_blocks for m in metas):
            return None
        buf = next((x for x in self.buffers if x.size >= b), None)
        if buf is None:
            return None
        buf.fill(ids, positions, metas)
        if buf.graph is None:  # eager over the padded buffers (no capture: tests, CPU)
            return self._forward(buf)[:b]
        buf.graph.replay()
        return buf.out[:b]
