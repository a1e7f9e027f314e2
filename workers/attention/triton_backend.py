"""Attention on a GPU through the Triton kernels (kernels/triton): all decode rows of a step in
one split-KV launch (plus its merge), all prefill chunks in one more.

The metadata is built on the host as for every backend, then its index tensors move to the
device once per step and KV group (`build_metadata`), so a layer's launches need no host-device
copies or syncs: padded decode tables, visible key ranges, and the prefill chunks' tables,
starts, lengths, first positions and key floors (the longest chunk stays a host int: it sizes
the launch grid).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.workers.attention.base import AttentionBackend
from deepinfer.workers.attention.metadata import AttentionMetadata, SeqSlice


@dataclass
class PrefillLaunch:
    """Every prefill chunk of a step, as prefill_attention takes them (device tensors)."""

    tables: torch.Tensor  # [S, MB] int32, -1 padded
    q_start: torch.Tensor  # [S] int32: first row in the step's batch
    q_len: torch.Tensor  # [S] int32
    q_pos0: torch.Tensor  # [S] int32: first query position, counted from the first table block
    key_lo: torch.Tensor  # [S] int32: keys below this (same origin) are masked
    max_q_len: int


@dataclass
class TritonMetadata(AttentionMetadata):
    device_tables = True  # (the fields below)
    decode_tables: torch.Tensor | None = None  # [B, MB] on the device
    decode_rows_dev: torch.Tensor | None = None
    decode_lo_dev: torch.Tensor | None = None
    decode_hi_dev: torch.Tensor | None = None
    prefill_launch: PrefillLaunch | None = None


def _prefill_launch(meta: AttentionMetadata, device: torch.device) -> PrefillLaunch | None:
    ps = meta.prefills
    if not ps:
        return None
    tables = torch.full((len(ps), max(len(p.blocks) for p in ps)), -1, dtype=torch.int32)
    for i, p in enumerate(ps):
        tables[i, : len(p.blocks)] = p.blocks
    ints = torch.tensor([[p.start, p.end - p.start, p.start_pos - p.first_key,
                          max(p.key_from - p.first_key, 0)] for p in ps], dtype=torch.int32)
    ints = ints.t().contiguous().to(device, non_blocking=True)
    return PrefillLaunch(tables.to(device, non_blocking=True), ints[0], ints[1], ints[2],
                         ints[3], max(p.end - p.start for p in ps))


# --deterministic: decode splits of this many keys from each row's first key, whatever the batch
# (kernels/triton/decode_attention.py).
KEYS_PER_SPLIT = 256


class TritonAttention(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)

    def build_metadata(self, slices: list[SeqSlice], block_size: int,
                       window: int | None) -> TritonMetadata:
        return self.on_device(AttentionMetadata.build(self.token_rows(slices), block_size,
                                                      window))

    def on_device(self, base: AttentionMetadata) -> TritonMetadata:
        """`base` (host tensors, as every backend builds it) with the index tensors the kernels
        read copied to the device, once."""
        meta = TritonMetadata(**{f: getattr(base, f) for f in base.__dataclass_fields__})
        dev = self.device
        meta.row_slots = base.row_slots.to(dev, non_blocking=True)
        if base.decode_rows is not None:
            rows = len(base.decode_rows)
            meta.decode_tables = base.decode_blocks.view(rows, -1).to(dev, non_blocking=True)
            meta.decode_rows_dev = base.decode_rows.to(dev, non_blocking=True)
            meta.decode_lo_dev = base.decode_lo.to(dev, non_blocking=True)
            meta.decode_hi_dev = base.decode_hi.to(dev, non_blocking=True)
        meta.prefill_launch = _prefill_launch(base, dev)
        return meta

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float
                ) -> torch.Tensor:
        from deepinfer.kernels.triton.decode_attention import paged_decode_attention
        from deepinfer.kernels.triton.prefill_attention import prefill_attention

        if not meta.device_tables:  # built by another backend (a test, a tool)
            meta = self.on_device(meta)
        split = KEYS_PER_SPLIT if self.row_invariant else None
        if meta.decode_rows is not None and meta.prefill_launch is None:
            return paged_decode_attention(q, k_cache, v_cache, meta.decode_tables,
                                          meta.decode_lo_dev, meta.decode_hi_dev, scale,
                                          keys_per_split=split)
        out = torch.empty_like(q)
        if meta.decode_rows is not None:
            rows = meta.decode_rows_dev
            out[rows] = paged_decode_attention(q[rows], k_cache, v_cache, meta.decode_tables,
                                               meta.decode_lo_dev, meta.decode_hi_dev, scale,
                                               keys_per_split=split)
        p = meta.prefill_launch
        if p is not None:
            prefill_attention(q, k_cache, v_cache, p.tables, p.q_start, p.q_len, p.q_pos0,
                              p.key_lo, scale, p.max_q_len, window=meta.window, out=out)
        return out
