"""The attention-backend seam: one object a model's attention layers call, chosen at load.

A backend turns a step's metadata (workers/attention/metadata.py, built once per step and KV
group) and a layer's q, k, v and paged cache into the attention output. Backends differ in how
they read the cache (a native CPU kernel, gather + SDPA in plain torch, Triton on CUDA) but not
in what they compute: tests hold each to the torch reference.
"""

from __future__ import annotations

import dataclasses

import torch

from deepinfer.workers.attention.metadata import AttentionMetadata, SeqSlice


class AttentionBackend:
    name = "base"
    # True when decode attention is the native CPU kernel that the one-call decode layer
    # (kernels/cpu/decode_layer.py) calls itself.
    native_decode = False
    # True when a decode step's attention needs no host work once its metadata sits in static
    # device buffers (workers/cuda_graphs.py), so the forward can be replayed as a CUDA graph.
    supports_cuda_graphs = False
    # --deterministic (workers/deterministic.py): every token is a decode row, prompt chunks
    # too, so a query's keys are read the same way in a chunk, a decode or after a prefix hit.
    row_invariant = False

    def build_metadata(self, slices: list[SeqSlice], block_size: int,
                       window: int | None) -> AttentionMetadata:
        return AttentionMetadata.build(self.token_rows(slices), block_size, window)

    def token_rows(self, slices: list[SeqSlice]) -> list[SeqSlice]:
        """The step's slices, each token its own decode row when row-invariant."""
        if not self.row_invariant:
            return slices
        return [s if s.verify or s.num_tokens == 1 else dataclasses.replace(s, verify=True)
                for s in slices]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """q [T, H, D]; k, v [T, KVH, D] (this step's, already in the cache) -> [T, H, D]."""
        raise NotImplementedError
