"""Per-step attention metadata over the paged KV cache, built once per step and KV group.

A layer's cache is two tensors [num_blocks, block_size, kv_heads, head_dim]. A step writes its
new K/V at `row_slots` (slot = block * block_size + offset; the rotary op does it, fused with
the rotation); then decode rows (one query each) attend over their block tables with per-row
visible key ranges [lo, hi), and each prefill chunk over its gathered blocks. Sliding-window
layers see keys in (q - W, q] and touch only the blocks that window covers; their block tables
hold -1 where a block fell out of the window and was freed. Every attention backend reads the
same metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class SeqSlice:
    """One request's part of a step, for one KV group."""

    table: np.ndarray  # block ids (-1: freed, outside a sliding window)
    start: int  # position of the first token computed in this step
    num_tokens: int
    write_from: int = 0  # positions below this already have their K/V in the cache
    key_from: int = 0  # keys below this were never computed (sliding replay): masked
    # A decode's input token followed by drafts to verify: each token is its own decode row,
    # attending causally up to itself (this step's K/V is in the cache before attention),
    # so verification runs on the decode path (native kernel, one-call decode layer).
    verify: bool = False


@dataclass
class PrefillSeq:
    start: int  # first row of this chunk in the flattened batch
    end: int
    blocks: torch.Tensor  # the blocks its keys live in, from `first_key` on
    first_key: int  # position of the first gathered key (block aligned)
    ctx_len: int
    start_pos: int  # position of the chunk's first token
    fresh: bool  # the chunk is the whole context: attend to this step's K/V directly
    key_from: int = 0

    def mask(self, window: int | None) -> torch.Tensor:
        """[n, ctx] True where a query may see a gathered key (causal, replay start, window)."""
        q_pos = torch.arange(self.start_pos, self.ctx_len).unsqueeze(1)
        key_pos = torch.arange(self.first_key, self.ctx_len).unsqueeze(0)
        mask = (key_pos <= q_pos) & (key_pos >= self.key_from)
        if window is not None:
            mask &= key_pos > q_pos - window
        return mask


@dataclass
class AttentionMetadata:
    # (A class attribute, not a field.) True where the decode rows' tables and key ranges are
    # also on the device (decode_tables, decode_lo_dev, decode_hi_dev: Triton's metadata), so
    # a kernel reads them with no host-device copy.
    device_tables = False

    row_slots: torch.Tensor  # [T] int64 cache slot of every row's K/V; -1: not written
    decode_rows: torch.Tensor | None  # [B] rows of single-token (decode) queries
    decode_blocks: torch.Tensor | None  # [B * MB] padded block tables, flattened
    prefills: list[PrefillSeq]
    window: int | None
    # Visible keys of each decode row, [lo, hi) relative to its first gathered key.
    decode_lo: torch.Tensor | None = None
    decode_hi: torch.Tensor | None = None
    # What it was built from, for models that walk their seqs themselves (DeepSeek-V4).
    seqs: list[SeqSlice] | None = None
    block_size: int = 0

    def decode_mask(self, num_keys: int) -> torch.Tensor:
        """[B, 1, 1, num_keys] True where a key is visible (the gather + SDPA fallback)."""
        keys = torch.arange(num_keys)
        mask = (keys >= self.decode_lo[:, None]) & (keys < self.decode_hi[:, None])
        return mask[:, None, None, :]

    @classmethod
    def build(cls, seqs: list[SeqSlice], block_size: int, window: int | None = None
              ) -> AttentionMetadata:
        slot_parts, prefills = [], []
        dec_rows, dec_tables, dec_first, dec_pos, dec_from = [], [], [], [], []
        row = 0
        for s in seqs:
            pos = np.arange(s.start, s.start + s.num_tokens, dtype=np.int64)
            slots = s.table[pos // block_size].astype(np.int64) * block_size + pos % block_size
            slots[pos < s.write_from] = -1  # replay: full layers already hold these
            slot_parts.append(slots)
            end = s.start + s.num_tokens
            first_key = s.key_from if window is None else max(s.key_from, s.start - window + 1)
            first_block = max(0, first_key) // block_size
            used = np.maximum(s.table[first_block: -(-end // block_size)], 0).astype(np.int64)
            if s.num_tokens == 1 or s.verify:
                for j in range(s.num_tokens):
                    dec_rows.append(row + j)
                    dec_tables.append(used)
                    dec_first.append(first_block * block_size)
                    dec_pos.append(s.start + j)
                    dec_from.append(s.key_from)
            else:
                fresh = s.start == 0 and (window is None or s.num_tokens <= window)
                prefills.append(PrefillSeq(row, row + s.num_tokens, torch.from_numpy(used),
                                           first_block * block_size, end, s.start, fresh,
                                           s.key_from))
            row += s.num_tokens
        meta = cls(torch.from_numpy(np.concatenate(slot_parts)), None, None, prefills, window,
                   seqs=seqs, block_size=block_size)
        if dec_rows:
            width = max(len(t) for t in dec_tables)
            padded = np.zeros((len(dec_tables), width), dtype=np.int64)
            for i, t in enumerate(dec_tables):
                padded[i, : len(t)] = t
            q_pos = np.asarray(dec_pos)
            lo = np.maximum(np.asarray(dec_from), 0)
            if window is not None:
                lo = np.maximum(lo, q_pos - window + 1)
            first = np.asarray(dec_first)
            meta.decode_lo = torch.from_numpy((lo - first).astype(np.int32))
            meta.decode_hi = torch.from_numpy((q_pos + 1 - first).astype(np.int32))
            meta.decode_rows = torch.tensor(dec_rows, dtype=torch.int64)
            meta.decode_blocks = torch.from_numpy(padded.reshape(-1))
        return meta
