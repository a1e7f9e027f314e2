"""Attention backends behind one interface (base.py); `select_backend` picks one at load."""

from __future__ import annotations

import torch

from deepinfer.kernels.cpu import attention as cpu_attention
from deepinfer.workers.attention.base import AttentionBackend
from deepinfer.workers.attention.metadata import AttentionMetadata, SeqSlice
from deepinfer.workers.attention.torch_backend import TorchAttention

__all__ = ["AttentionBackend", "AttentionMetadata", "SeqSlice", "select_backend"]


def select_backend(device: torch.device | str, dtype: torch.dtype) -> AttentionBackend:
    """Triton on CUDA devices, the native CPU kernel where it builds and takes the dtype, plain
    torch elsewhere."""
    if torch.device(device).type == "cuda":
        from deepinfer.workers.attention.triton_backend import TritonAttention

        return TritonAttention(device)
    probe = torch.empty(0, device=device, dtype=dtype)
    if cpu_attention.available(probe):
        from deepinfer.workers.attention.cpu_backend import CpuAttention

        return CpuAttention()
    return TorchAttention()
