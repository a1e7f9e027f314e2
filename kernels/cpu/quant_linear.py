"""Linear layers on quantized weights (int8, fp8 e4m3, 4-bit) on CPU: native kernels.

- `quant_linear_small_m`: decode batches (M <= 4), bound by reading the weight: the quantized
  bytes stream once for all rows and are dequantized in registers (csrc/quant_linear.cpp).
- `quant_linear_int_gemm`: any M, int8 (groups of a multiple of 32) and 4-bit weights as an
  integer GEMM over repacked tiles (AVX512-VNNI: one instruction a tile quad, 64 products);
  `quant_linear` picks it or the small-M kernel by the rows.
- `quant_linear_dequant`: any M; each thread dequantizes a cache-sized tile of weight rows and
  multiplies it with a GEMM (the path for prefill chunks when no int8 GEMM takes the weight).

The weight layouts are workers/quantization/weight.py's (the dtype tells which); `reference` is
its dequantization followed by F.linear. Call `available` first; it never raises.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.kernels.cpu.native import NativeOp

_OP = NativeOp("quant_linear", "quant_linear.cpp", "quant_linear_small_m")


def available(*tensors: torch.Tensor) -> bool:
    """True when the kernels are built (building them on first call) and take these float32
    inputs (the weights' own layouts are checked by the kernels)."""
    return _OP.available(*tensors)


def build_error() -> str | None:
    return _OP.error


def quant_linear_small_m(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                         mins: torch.Tensor | None = None,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32 -> [..., N], reading qweight once for all rows (meant for M <= 4)."""
    return _OP(x, qweight, scales, mins, bias)


def quant_linear_dequant(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                         mins: torch.Tensor | None = None,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product for any M, through dequantized tiles and a GEMM."""
    return _OP.sibling("quant_linear_dequant")(x, qweight, scales, mins, bias)


def quant_linear_int_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                          mins: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                          tiles: torch.Tensor | None = None) -> torch.Tensor:
    """int8 (groups of a multiple of 32) or 4-bit weights for any M, computing what the small-M
    kernel computes (activations int8 per block of 32) as a register-blocked integer GEMM.
    `tiles`: the weight as `quant_linear_pack` made it (else each call packs its tiles)."""
    return _OP.sibling("quant_linear_int_gemm")(x, qweight, scales, mins, bias, tiles)


def quant_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 mins: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 tiles: torch.Tensor | None = None) -> torch.Tensor:
    """A product of any M through the kernel that takes those rows fastest: the small-M kernel
    for decode batches, the integer GEMM above them (with an int8 weight's tiles kept and
    AVX512-VNNI, from 3 rows). The GEMM's weights only (int8 in groups of a multiple of 32,
    4-bit) above 4 rows."""
    return _OP.sibling("quant_linear")(x, qweight, scales, mins, bias, tiles)


def quant_linear_pack(qweight: torch.Tensor, scales: torch.Tensor,
                      mins: torch.Tensor | None = None) -> torch.Tensor:
    """The weight as the integer GEMM reads it, made once: per 16 output rows, the int8 values
    (4-bit: unpacked to bytes) in groups of 4 along K, then the scales (and mins) per block of
    32 as floats; int32 [ceil(N / 16), ints]. int8 weights: +12.5 % over their bytes; 4-bit:
    2.5x theirs. Empty where the GEMM has no packed form (a CPU without AVX2)."""
    return _OP.sibling("quant_linear_pack")(qweight, scales, mins)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
              ) -> torch.Tensor:
    """What both kernels compute: `weight` is the dequantized [N, K] float weight."""
    return F.linear(x, weight.to(x.dtype), bias)


def quantize_activations(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x as the small-M kernels see it: int8 per `block` elements (32 for int8 and 4-bit
    weights, 256 for K-quants; scale max |x| / 127, round half to even), back in float32."""
    blocks = x.float().reshape(*x.shape[:-1], -1, block)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(blocks * inv) * d).reshape(x.shape)
