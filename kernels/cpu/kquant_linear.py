"""Linear layers on GGUF K-quant weights (Q4_K, Q5_K, Q6_K) as the file stores them, on CPU:
native kernels (csrc/kquant_linear.cpp).

- `kquant_linear`: activations as int8 per 256 (llama.cpp's Q8_K). Decode batches (up to
  SMALL_M rows) are bound by reading the weight: the super-blocks stream once for all rows.
  Where `int8_gemm()` (AVX512-VNNI), more rows (prefill) go through an integer GEMM on the
  weight's codes as u8 lanes, packed per call: 64 products an instruction, twice a bf16 GEMM's.
- `kquant_dequant_linear`: any M, through dequantized tiles and a GEMM (prefill without
  AVX512-VNNI): bf16 tiles, activations and products where oneDNN has a bf16 GEMM
  (AVX512-BF16: ~2x float32's at 256 rows here; the tile, the activations and the output rounded
  to bf16, 2^-9 relative each), else float32.
- `kquant_pack_lanes` / `kquant_lanes_linear`: the weight repacked once (at load, a second copy
  of about its size) into strips of 16 output rows whose codes unpack straight into the int8
  GEMM's lanes, from LANES_MIN_ROWS rows (the streaming kernel is faster below):
  at 8 rows ~1.6x the streaming kernel (which is compute-bound there), the GEMM without the
  per-call unpacking at prefill. Needs `int8_gemm()` and N a multiple of 32.
- `kquant_dequantize`: the float32 rows (embedding lookups, the reference's weight).

`blocks` is uint8 [N, K / 256 * block bytes] (workers/quantization/weight.py's "k-quant"
layout); `ggml_type` llama.cpp's type id. Call `available` first; it never raises.
"""

from __future__ import annotations

import torch

from deepinfer.kernels.cpu.native import NativeOp

_OP = NativeOp("kquant_linear", "kquant_linear.cpp", "kquant_linear")
SMALL_M = 16  # the rows kquant_linear takes; more go through dequantized tiles
LANES_MIN_ROWS = 4  # the fewest rows kquant_lanes_linear takes (kernels/cpu/csrc/decode_layer.cpp)
BF16_TILES = torch.ops.mkldnn._is_mkldnn_bf16_supported()


def available(*tensors: torch.Tensor) -> bool:
    """True when the kernels are built (building them on first call) and take these tensors."""
    return _OP.available(*tensors)


def int8_gemm() -> bool:
    """True when `kquant_linear` takes any row count (the build has AVX512-VNNI): callers
    need `kquant_dequant_linear` above SMALL_M only where this is False."""
    return available() and bool(_OP.sibling("kquant_int8_gemm")())


def build_error() -> str | None:
    return _OP.error


def kquant_linear(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32 -> [..., N]: up to SMALL_M rows reading the blocks once for all of
    them; more through the integer GEMM where `int8_gemm()` (else one element at a time:
    slow)."""
    return _OP(x, blocks, ggml_type, bias)


def kquant_dequant_linear(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int,
                          bias: torch.Tensor | None = None,
                          bf16: bool = BF16_TILES) -> torch.Tensor:
    """The same product for any M, through dequantized tiles and a GEMM (`bf16`: in bf16)."""
    return _OP.sibling("kquant_dequant_linear")(x, blocks, ggml_type, bias, bf16)


def kquant_dequantize(blocks: torch.Tensor, ggml_type: int, cols: int) -> torch.Tensor:
    """The float32 [N, cols] weight the blocks stand for."""
    return _OP.sibling("kquant_dequantize")(blocks, ggml_type, cols)


def kquant_pack_lanes(blocks: torch.Tensor, ggml_type: int, cols: int) -> torch.Tensor | None:
    """The lanes layout of [N, cols] blocks, or None where it does not apply (no AVX512-VNNI,
    N not a multiple of 32)."""
    if not int8_gemm() or blocks.shape[0] % 32:
        return None
    return _OP.sibling("kquant_pack_lanes")(blocks, ggml_type, cols)


def kquant_lanes_linear(x: torch.Tensor, lanes: torch.Tensor, ggml_type: int,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32 -> [..., N] from `kquant_pack_lanes`' layout, activations as
    `kquant_linear`'s (int8 per 256): the same products."""
    return _OP.sibling("kquant_lanes_linear")(x, lanes, ggml_type, bias)
