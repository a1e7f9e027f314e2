"""Linear layers on bfloat16 weights with float32 activations on CPU (csrc/bf16_linear.cpp):
decode batches up to SMALL_M rows read the bf16 weight once, activations rounded to bf16 and
met with AVX512-BF16 dot products. Larger M: `bf16_linear`, oneDNN's bf16 GEMM on the same
rounded activations, its output rounded to bf16 too (2^-9 relative: no float32-output bf16 GEMM
on CPU in torch). With the strips copy (`bf16_pack_strips`, a second copy of the weight, kept
at load), decode batches take `bf16_strips_linear`: 16 output rows a 64-byte line, so an
activation pair broadcast feeds them all (8 rows ~1.5x the row-major kernel, which reloads
activations per weight row; 1 row ~1.1x). Call `available` first; it never raises."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.kernels.cpu.native import NativeOp

_OP = NativeOp("bf16_linear", "bf16_linear.cpp", "bf16_linear_small_m")
SMALL_M = 16  # the rows the streaming kernel takes; more go through the GEMM


def available() -> bool:
    """True when the kernel is built (building it on first call)."""
    return _OP.available()


def build_error() -> str | None:
    return _OP.error


def bf16_linear_small_m(x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32, weight bfloat16 [N, K] -> float32 [..., N]."""
    return _OP(x, weight, bias)


def bf16_linear(x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """Any M: oneDNN's bf16 GEMM on x rounded to bf16 (its output rounded to bf16 as well),
    returned as float32."""
    y = F.linear(x.to(torch.bfloat16), weight).float()
    return y if bias is None else y.add_(bias)


def bf16_pack_strips(weight: torch.Tensor) -> torch.Tensor | None:
    """The strips copy of a bf16 [N, K] weight, or None where it does not apply (no
    AVX512-BF16, N not a multiple of 32, K odd)."""
    if (not available() or not _OP.sibling("bf16_strips")() or weight.shape[0] % 32
            or weight.shape[1] % 2):
        return None
    return _OP.sibling("bf16_pack_strips")(weight)


def bf16_strips_linear(x: torch.Tensor, strips: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32 -> [..., N] from `bf16_pack_strips`' copy: the small-M kernel's
    products, summed in another order."""
    return _OP.sibling("bf16_strips_linear")(x, strips, bias)
