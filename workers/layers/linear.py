"""Linear layers with the fastest CPU paths measured here.

- Decode batches (M <= 4): the native weight-streaming kernel (kernels/cpu_linear.py) reads the
  plain [out, in] weight once for all rows: ~18 ms for a SmolLM2 token's linears against ~27 ms
  for oneDNN and ~50 ms for F.linear.
- Larger M (prefill chunks, big decode batches): oneDNN-packed float32 weights via
  `mkldnn._linear_pointwise` (1.6-3x faster than MKL's small-M GEMM, see DESIGN.md); the weight
  is reordered once by `finalize()`.
- Elsewhere (CUDA, half precision, no compiler, no mkldnn): plain `F.linear`.
On CPU both copies of a weight are kept (the packed one and the plain one): twice the weight
memory, for the fastest path at every batch size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import linear as cpu_linear

SMALL_M = 4  # largest batch the weight-streaming kernel handles better than a GEMM


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
        self._small_m = False
        # Plain attributes for the hot path (nn.Module's parameter lookup costs ~1 us a call).
        self._w: torch.Tensor | None = None
        self._b: torch.Tensor | None = None

    def finalize(self, pack: bool = True) -> None:
        """Called once after the weights are loaded."""
        w = self.weight.data
        self._small_m = w.is_contiguous() and cpu_linear.available(w, self.bias)
        if pack and _can_pack(w):
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
            if not self._small_m:
                self.weight.data = torch.empty(0)  # the packed copy is the only one needed
        self._w = self.weight.data
        self._b = None if self.bias is None else self.bias.data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._small_m and x.shape[0] <= SMALL_M:
            return cpu_linear.linear_small_m(x, self._w, self._b)
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self._b, "none", [], "")
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
