"""RMSNorm computed in float32, as the HF reference does, optionally fused with the residual add."""

from __future__ import annotations

import torch
from torch import nn

from kernels import cpu_fused


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Norm of x, or with `residual`: residual += x (in place), then the norm of the sum."""
        if x.is_contiguous() and cpu_fused.available(x, residual):
            return cpu_fused.add_rms_norm(x, residual, self.weight, self.eps)
        return cpu_fused.add_rms_norm_ref(x, residual, self.weight, self.eps)
