"""Linear layers on bfloat16 weights with float32 activations on CPU (csrc/bf16_linear.cpp):
decode batches up to SMALL_M rows read the bf16 weight once, activations rounded to bf16 and
met with AVX512-BF16 dot products. Larger M: `bf16_linear`, oneDNN's bf16 GEMM on the same
rounded activations, its output rounded to bf16 too (2^-9 relative: no float32-output bf16 GEMM
on CPU in torch). Call `available` first; it never raises."""

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
