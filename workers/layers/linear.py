"""Linear layers with the fastest CPU paths measured here, and a choice of weight copies.

- Decode batches (M <= 4): the native weight-streaming kernel (kernels/cpu/linear.py) reads the
  plain [out, in] weight once for all rows: ~18 ms for a SmolLM2 token's linears against ~27 ms
  for oneDNN and ~50 ms for F.linear.
- Larger M (prefill chunks, big decode batches): oneDNN-packed float32 weights via
  `mkldnn._linear_pointwise` (1.6-3x faster than MKL's small-M GEMM at 4-64 rows); the weight
  is reordered once by `finalize()`.
- Elsewhere (CUDA, half precision, no compiler, no mkldnn): plain `F.linear`.
- Quantized weights (a GGUF's or an fp8 checkpoint's as loaded, or --quantization int8 / fp8 at
  `finalize`): workers/quantization/matmul.py, which picks its own paths by batch size.

The two fast paths need different copies of a weight. `finalize(copies=...)` keeps "both" (the
fastest path at every batch size, twice the weight memory), "packed" (oneDNN at every batch
size: batch-1 decode is slower) or "plain" (the small-M kernel, then F.linear above 4 rows).
The loader picks per model (`resolve_weight_copies`): both while the second copy is cheap.
Quantized weights keep the integer GEMM's repacked copy too with "both" (QuantizedMatmul); with
one copy, the quantized weight itself (the decode kernel reads it; the GEMM repacks per call).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.kernels.cpu import linear as cpu_linear
from deepinfer.kernels.cpu.decode_layer import EMPTY, PART_BF16, LinearWeights
from deepinfer.workers.layers import gpu_kernels
from deepinfer.workers.layers.checkpoint_tensor import materialize
from deepinfer.workers.quantization.fp8 import quantize_fp8_weight
from deepinfer.workers.quantization.matmul import QuantizedMatmul, packed_bytes
from deepinfer.workers.quantization.weight import QuantizedWeight, cat_rows, quantize_int8

SMALL_M = 4  # largest batch the weight-streaming kernel handles better than a GEMM
WEIGHT_COPIES = ("auto", "both", "packed", "plain")


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def resolve_weight_copies(copies: str, linear_bytes: int, memory_bytes: int | None = None) -> str:
    """"auto": both copies while the second costs at most a quarter of the machine's memory
    (24 GiB: SmolLM2-135M's 0.5 GB, an 8B Q4_K_M's 4.4 GiB lanes copy and a 1B float32 model's 4
    GB, both; a 3B float32 model's 12 GB, packed only)."""
    if copies not in WEIGHT_COPIES:
        raise ValueError(f"weight copies must be one of {WEIGHT_COPIES}, not {copies!r}")
    if copies != "auto":
        return copies
    if memory_bytes is None:
        memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return "both" if linear_bytes <= memory_bytes // 4 else "packed"


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        )
        self.packed: torch.Tensor | None = None  # the oneDNN-packed weight
        self.small_m = False  # the plain weight is kept and the small-M kernel takes it
        # --deterministic (workers/deterministic.py): the small-M kernel at every row count; its
        # sums per output run in one order whatever M is, so a row's result never depends on
        # the batch it came in.
        self.row_invariant = False
        # Plain attributes for the hot path (nn.Module's parameter lookup costs ~1 us a call).
        self._w: torch.Tensor | None = None
        self._b: torch.Tensor | None = None
        # A quantized weight as the checkpoint had it (per fused part, in order), and how it is
        # multiplied once final; then `weight` is left empty.
        self.quantized_parts: dict[str | None, QuantizedWeight] = {}
        self.quant: QuantizedMatmul | _ConcatMatmul | None = None

    def load_quantized(self, weight: QuantizedWeight, part: str | None = None) -> None:
        self.quantized_parts[part] = weight

    def finalize(self, copies: str = "both", quantization: str | None = None) -> None:
        """Called once after the weights are loaded; `copies`: both, packed or plain;
        `quantization`: None (as loaded), none (float), int8 or fp8 (engine/config.py)."""
        self._b = None if self.bias is None else self.bias.data
        if self._finalize_quantized(quantization, pack=copies == "both"):
            return
        w = self.weight.data
        native = w.is_contiguous() and cpu_linear.available(w, self.bias)
        self.small_m = native and copies in ("both", "plain")
        if copies in ("both", "packed") and can_pack(w):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
            if not self.small_m:
                self.weight.data = torch.empty(0)  # the packed copy is the only one needed
        self._w = self.weight.data

    def _finalize_quantized(self, quantization: str | None, pack: bool = True) -> bool:
        """Settle the weight's final form; True when it ends quantized. `pack`: keep the
        integer GEMM's pre-packed copy too (QuantizedMatmul)."""
        parts = list(self.quantized_parts.values())
        self.quantized_parts = {}
        if quantization == "none" or (quantization is not None and parts and any(
                p.kind != quantization for p in parts)):
            if parts:  # back to float (then quantized again below, if asked)
                self.weight.data = torch.cat([p.dequantize() for p in parts])
                parts = []
        if not parts and quantization in ("int8", "fp8"):
            w = self.weight.data
            quantized = quantize_int8(w) if quantization == "int8" else quantize_fp8_weight(w)
            if not isinstance(quantized, QuantizedWeight):  # no whole fp8 blocks: stays float
                return False
            parts = [quantized]
        if not parts:
            return False
        if len(parts) > 1 and (len({(p.kind, p.group_size) for p in parts}) > 1
                               or parts[0].ggml_type is not None):
            # Parts quantized differently (a Q4_K_M GGUF's q|k|v), or K-quant blocks (views of
            # the mapped file, not copied into one): one product each.
            self.quant = _ConcatMatmul([QuantizedMatmul(p, None, pack) for p in parts], self._b)
        else:
            self.quant = QuantizedMatmul(cat_rows(parts) if len(parts) > 1 else parts[0],
                                         self._b, pack)
        self.weight.data = torch.empty(0)
        self._w = self.weight.data
        return True

    def second_copy_bytes(self) -> int:
        """Before `finalize`: what keeping both copies adds (the oneDNN-packed float weight, or
        the integer GEMM's packed quantized one)."""
        if self.quantized_parts:
            return sum(packed_bytes(p) for p in self.quantized_parts.values())
        return self.weight.numel() * self.weight.element_size()

    def weights(self) -> LinearWeights | None:
        """The weights as the one-call decode layer reads them; None when it cannot."""
        if self.quant is not None:
            q = self.quant
            matmuls = q.parts if isinstance(q, _ConcatMatmul) else [q]
            if all(m.native and m.weight.scales is None for m in matmuls):  # K-quant, bf16
                return LinearWeights(EMPTY, None, self._b,
                                     parts=tuple(m.weight.qweight for m in matmuls),
                                     part_kinds=tuple(m.kquant if m.kquant is not None
                                                      else PART_BF16 for m in matmuls),
                                     part_lanes=tuple(EMPTY if m.lanes is None else m.lanes
                                                      for m in matmuls))
            if not isinstance(q, QuantizedMatmul) or not q.native or q.weight.scales is None:
                return None
            # (With FBGEMM opted in, more than 4 rows stay on the Python path that calls it.)
            return LinearWeights(q.weight.qweight, q.tiles, self._b, q.weight.scales, q.weight.mins,
                                 int_gemm=q.int_gemm and q.packed is None)
        if not (self.small_m or self.packed is not None):
            return None
        return LinearWeights(self._w if self.small_m else EMPTY, self.packed, self._b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant(x)
        if self.small_m and (x.shape[0] <= SMALL_M or self.row_invariant):
            return cpu_linear.linear_small_m(x, self._w, self._b)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self._b, "none", [], "")
        if self.row_invariant and x.is_cuda:  # (cuBLAS picks its sums' order by M)
            return gpu_kernels.linear_rows(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input in one weight (q|k|v, gate|up).

    The loader fills each part by name through `load_part`.
    """

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False,
                 sources: dict[str, int] | None = None) -> None:
        """`parts`: each projection's rows here; `sources`: where they start in the
        checkpoint's tensor (tensor parallelism: this rank's shard; default 0)."""
        super().__init__(in_features, sum(parts.values()), bias)
        self.parts: dict[str, tuple[int, int]] = {}
        self.sources = sources or {}
        offset = 0
        for name, size in parts.items():
            self.parts[name] = (offset, size)
            offset += size

    def part_rows(self, part: str, tensor: torch.Tensor | QuantizedWeight
                  ) -> torch.Tensor | QuantizedWeight:
        """This rank's rows of the checkpoint's whole `part` tensor."""
        return tensor.narrow(0, self.sources.get(part, 0), self.parts[part][1])

    def load_part(self, part: str, tensor: torch.Tensor | QuantizedWeight,
                  is_bias: bool = False) -> None:
        offset, size = self.parts[part]
        target = self.bias if is_bias else self.weight
        tensor = self.part_rows(part, tensor)
        if isinstance(tensor, QuantizedWeight) and not is_bias:
            self.load_quantized(tensor, part)
            return
        target.data[offset: offset + size].copy_(materialize(tensor))

    def load_quantized(self, weight: QuantizedWeight, part: str | None = None) -> None:
        super().load_quantized(weight, part)
        if part is not None and len(self.quantized_parts) == len(self.parts):
            # Loaded in any order; fused in the order of the parts.
            self.quantized_parts = {p: self.quantized_parts[p] for p in self.parts}

    def _finalize_quantized(self, quantization: str | None, pack: bool = True) -> bool:
        if self.quantized_parts and len(self.quantized_parts) < len(self.parts):
            missing = sorted(set(self.parts) - set(self.quantized_parts))
            # Some parts came as floats: make them the same kind of weight as the others.
            for part in missing:
                offset, size = self.parts[part]
                self.quantized_parts[part] = quantize_int8(self.weight.data[offset:offset + size])
            self.quantized_parts = {p: self.quantized_parts[p] for p in self.parts}
        return super()._finalize_quantized(quantization, pack)


class PlainWeight(nn.Module):
    """A projection a model reads as a matrix and never calls (e.g. to absorb it into another
    product): kept as loaded, never packed or dropped by `finalize`."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)


def shard_on_load(param: torch.Tensor, dim: int, start: int, size: int) -> None:
    """The loader copies only [start, start + size) of the checkpoint's tensor along `dim` into
    `param` (a tensor-parallel shard), through the parameter's `load` hook."""
    param.load = lambda tensor: tensor.narrow(dim, start, size)


class RowParallelLinear(Linear):
    """A linear whose input features are split over the tensor-parallel ranks: each computes
    its partial product, then one all-reduce sums them (the bias counts once: rank 0's)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 shard: tuple[int, int] | None = None) -> None:
        """`shard`: (start, size) of this rank's input features (default: an equal part)."""
        from deepinfer.workers.distributed.parallel_state import tp

        self.tp = tp()
        start, size = shard or self.tp.shard(in_features, "input features")
        super().__init__(size, out_features, bias)
        shard_on_load(self.weight, 1, start, size)

    def after_load(self) -> None:
        if self.bias is not None and self.tp.rank:
            self.bias.data.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


class _ConcatMatmul:
    """A fused linear whose parts are quantized differently: each part's product, side by side."""

    def __init__(self, parts: list[QuantizedMatmul], bias: torch.Tensor | None) -> None:
        self.parts = parts
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([part(x) for part in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias
