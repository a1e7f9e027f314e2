"""Linear layers with the fastest CPU path measured here: oneDNN-packed float32 weights.

`finalize()` (after loading) reorders the weight once into oneDNN's blocked layout; every batch
size then runs through `mkldnn._linear_pointwise` (1.6-3x faster than MKL's small-M GEMM, see
DESIGN.md). Elsewhere (CUDA, half precision, no mkldnn) it is plain `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        )
        self._packed: torch.Tensor | None = None

    def finalize(self, pack: bool = True) -> None:
        """Called once after the weights are loaded."""
        if pack and _can_pack(self.weight):
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, 64)
            # The packed copy replaces the plain one (keeps memory at one copy).
            self.weight.data = torch.empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input in one weight (q|k|v, gate|up).

    The loader fills each part by name through `load_part`.
    """

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(parts.values()), bias)
        self.parts: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in parts.items():
            self.parts[name] = (offset, size)
            offset += size

    def load_part(self, part: str, tensor: torch.Tensor, is_bias: bool = False) -> None:
        offset, size = self.parts[part]
        target = self.bias if is_bias else self.weight
        target.data[offset: offset + size].copy_(tensor)
