"""RMSNorm computed in float32, as the HF reference does, optionally fused with the residual add."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.kernels.cpu import fused as cpu_fused
from deepinfer.workers.layers import gpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        # Gemma stores w and scales by (1 + w): the offset is folded into the weight once,
        # after loading, so every path (native or not) computes a plain RMSNorm.
        self.offset = offset
        self.native_weight: torch.Tensor | None = None  # set by finalize() when native
        self.triton = False  # set by finalize(): on a GPU

    def after_load(self) -> None:
        if self.offset:
            self.weight.data += self.offset

    def finalize(self) -> None:
        """Called once after the weights are loaded: picks the fused native op when it fits."""
        w = self.weight.data
        self.native_weight = w if cpu_fused.available(w) else None
        self.triton = gpu_kernels.wanted(w)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Norm of x, or with `residual`: residual += x (in place), then the norm of the sum."""
        w = self.native_weight
        if w is not None and x.is_contiguous():
            return cpu_fused.add_rms_norm(x, residual, w, self.eps)
        if self.triton and x.is_contiguous() and (residual is None or residual.is_contiguous()):
            return gpu_kernels.add_rms_norm(x, residual, self.weight, self.eps)
        return cpu_fused.add_rms_norm_ref(x, residual, self.weight, self.eps)
