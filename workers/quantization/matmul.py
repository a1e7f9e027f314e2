"""How a linear layer multiplies by a QuantizedWeight, chosen once when the weight is final.

- Up to SMALL_M rows (decode): the native small-M kernel (kernels/cpu/quant_linear.py), reading
  the quantized bytes once: a quarter (int8) or an eighth (4-bit) of float32's. int8 and 4-bit
  weights meet int8 activations there, per block of 32, which leaves the default model's greedy
  text as weight-only int8 has it.
- More rows, int8 weights in groups of a multiple of 32 (per channel, Q8_0) and 4-bit ones:
  the native integer GEMM, with the same numerics (activations int8 per block of 32): ~1.8x
  oneDNN's float32 at 64 rows here with AVX2, ~2.4x that with AVX512-VNNI (one instruction a
  tile quad); there int8 weights whose tiles are kept take it from 3 rows (`quant_linear`).
  A batch's rows then round as a lone decode row does. The GEMM reads the weight repacked
  (groups of 4 along K per 16 output rows, scales per block as floats); kept once made
  (`pack`, the default: +1.125x an int8 weight's bytes, +2.5x a 4-bit one's; 64 rows of the
  default model's linears 76 -> 65 ms int8, 54 -> 47 ms 4-bit), else
  made per call.
- More rows, other layouts (fp8): dequantized tiles and a float32 GEMM, natively, activations
  as they are.
- K-quants (GGUF Q4_K, Q5_K, Q6_K super-blocks as stored): kernels/cpu/kquant_linear.py. With
  AVX512-VNNI and the second copy kept, from 4 rows the lanes copy (repacked at load for the
  integer GEMM), below that the streaming kernel on the blocks; with one copy, the streaming
  kernel up to its SMALL_M rows (16: an 8-stream decode step reads the weight once), above it
  the integer GEMM unpacking the blocks per call (without VNNI dequantized tiles and a bf16 or
  float32 GEMM).
- bf16 (a bf16 checkpoint's weights under a float32 model): kernels/cpu/bf16_linear.py, the
  AVX512-BF16 streaming kernel up to 16 rows (on its strips copy, where kept),
  oneDNN's bf16 GEMM above; activations rounded to bf16 in all.
- More rows, int8 per output channel, with DEEPINFER_INT8_DYNAMIC_ACTIVATIONS=1: FBGEMM's
  u8 x s8 GEMM (`quantized::linear_dynamic`) instead, activations quantized per token to 7 bits
  (AVX2's reduce_range): ~10 % faster end to end at 64 concurrent than the integer GEMM (7 bits
  let it add pairs before widening), but coarser, which moves the default model's greedy text
  within a few tokens; so it is opt-in. FBGEMM keeps its own packed copy of the int8 weight.
- Without the native kernels (no compiler, another device): the dequantized weight and F.linear.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from deepinfer.engine import envs
from deepinfer.kernels.cpu import bf16_linear, kquant_linear
from deepinfer.kernels.cpu import quant_linear as native
from deepinfer.workers.quantization.weight import QuantizedWeight

SMALL_M = 4  # workers/layers/linear.py's: the decode rows the streaming kernels take


def _fbgemm_pack(weight: QuantizedWeight):
    """FBGEMM's packed int8 weight for a per-channel int8 weight, or None."""
    if (weight.kind != "int8" or weight.scales.shape[1] != 1
            or not {"x86", "fbgemm"} & set(torch.backends.quantized.supported_engines)):
        return None
    rows = weight.shape[0]
    with warnings.catch_warnings():  # quantized tensors are deprecated, FBGEMM's ops are not
        warnings.simplefilter("ignore", UserWarning)
        q = torch._make_per_channel_quantized_tensor(
            weight.qweight, weight.scales[:, 0].double(), torch.zeros(rows, dtype=torch.long), 0)
    return torch.ops.quantized.linear_prepack(q, None)


def int_gemm_takes(weight: QuantizedWeight) -> bool:
    """True for the weights the native integer GEMM multiplies: int8 in groups of a multiple of
    32 elements (per channel, Q8_0), and 4-bit."""
    return (weight.ggml_type is None and weight.kind in ("int8", "q4")
            and weight.group_size % 32 == 0)


def packed_bytes(weight: QuantizedWeight) -> int:
    """What the integer GEMM's pre-packed copy of `weight` takes (0: it takes no such copy);
    for K-quants, the lanes copy (about the blocks' own size)."""
    if weight.ggml_type is not None:
        takes = weight.shape[0] % 32 == 0 and kquant_linear.int8_gemm()
        return weight.qweight.numel() if takes else 0
    if weight.kind == "bf16":  # the strips copy (bf16_pack_strips)
        takes = weight.shape[0] % 32 == 0 and weight.shape[1] % 2 == 0
        return weight.qweight.numel() * 2 if takes else 0
    if not int_gemm_takes(weight):
        return 0
    rows, k = weight.shape
    per_row = k + (k // 32) * 4 * (2 if weight.kind == "q4" else 1)  # values, scales (+ mins)
    return -(-rows // 16) * 16 * per_row


class QuantizedMatmul:
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None,
                 pack: bool = True) -> None:
        self.weight = weight.contiguous()
        self.bias = bias
        self.kquant = weight.ggml_type
        self.packed = self.tiles = None
        self.int_gemm = self.kquant_int8_gemm = False
        # The second copy decode batches of 4 rows up read, if kept: K-quants' lanes
        # (kquant_pack_lanes), bf16 weights' strips (bf16_pack_strips).
        self.lanes = None
        if self.kquant is not None:  # K-quant blocks: their own kernels
            self.native = weight.qweight.device.type == "cpu" and kquant_linear.available()
            self.kquant_int8_gemm = self.native and kquant_linear.int8_gemm()
            if self.kquant_int8_gemm and pack:
                self.lanes = kquant_linear.kquant_pack_lanes(self.weight.qweight, self.kquant,
                                                             self.weight.shape[1])
            return
        if weight.kind == "bf16":
            self.native = weight.qweight.device.type == "cpu" and bf16_linear.available()
            if self.native and pack:
                self.lanes = bf16_linear.bf16_pack_strips(self.weight.qweight)
            return
        self.native = weight.qweight.device.type == "cpu" and native.available(
            torch.empty(1, weight.shape[1]))
        if self.native:  # shapes the kernels refuse (an odd K, groups they cannot take)
            try:
                native.quant_linear_small_m(torch.zeros(1, weight.shape[1]), self.weight.qweight,
                                            self.weight.scales, self.weight.mins)
            except RuntimeError:
                self.native = False
        self.packed = (_fbgemm_pack(self.weight)
                       if self.native and envs.int8_dynamic_activations() else None)
        # int8 in groups of a multiple of 32 (per channel, Q8_0) and 4-bit: the integer GEMM
        # above SMALL_M.
        self.int_gemm = self.native and int_gemm_takes(self.weight)
        self.tiles = None  # the integer GEMM's pre-packed weight
        if self.int_gemm and pack and self.packed is None:
            w = self.weight
            tiles = native.quant_linear_pack(w.qweight, w.scales, w.mins)
            self.tiles = tiles if tiles.numel() else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if not self.native or x.dtype != torch.float32:
            return F.linear(x, w.dequantize(x.dtype), self.bias)
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if w.scales is None and self.kquant is None:  # bf16
            small = rows <= bf16_linear.SMALL_M
            if small and self.lanes is not None:  # the strips copy: every decode batch
                return bf16_linear.bf16_strips_linear(x, self.lanes, self.bias)
            if small:
                return bf16_linear.bf16_linear_small_m(x, w.qweight, self.bias)
            return bf16_linear.bf16_linear(x, w.qweight, self.bias)
        if self.kquant is not None:
            if self.lanes is not None and rows >= kquant_linear.LANES_MIN_ROWS:
                return kquant_linear.kquant_lanes_linear(x, self.lanes, self.kquant, self.bias)
            if rows <= kquant_linear.SMALL_M or self.kquant_int8_gemm:
                return kquant_linear.kquant_linear(x, w.qweight, self.kquant, self.bias)
            return kquant_linear.kquant_dequant_linear(x, w.qweight, self.kquant, self.bias)
        if self.packed is not None and rows > SMALL_M:
            # FBGEMM quantizes its input per tensor; rows scaled to one max first make that per
            # token, and are scaled back after.
            scale = x.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-30)
            y = torch.ops.quantized.linear_dynamic(x / scale, self.packed, True).mul_(scale)
            return y if self.bias is None else y.add_(self.bias)
        if self.int_gemm:
            return native.quant_linear(x, w.qweight, w.scales, w.mins, self.bias, self.tiles)
        if rows <= SMALL_M:
            return native.quant_linear_small_m(x, w.qweight, w.scales, w.mins, self.bias)
        return native.quant_linear_dequant(x, w.qweight, w.scales, w.mins, self.bias)

    def nbytes(self) -> int:
        """The weight's bytes with its packed copy (FBGEMM's or the integer GEMM's)."""
        extra = self.weight.qweight.numel() if self.packed is not None else 0
        for copy in (self.tiles, self.lanes):
            if copy is not None:
                extra += copy.numel() * copy.element_size()
        return self.weight.nbytes() + extra
