"""A quantized [N, K] linear weight, in one of five self-describing layouts.

- int8 (`qweight` int8 [N, K]): symmetric, w = q * scale. Per output channel when quantized at
  load (one group of K), or per group of 32 / 16 (GGUF Q8_0 / Q6_K).
- fp8 (`qweight` float8_e4m3fn [N, K]): w = fp8(q) * scale, DeepSeek's 128 x 128 block scales
  kept as groups of 128 along K, repeated per row (1/32 of the weight's bytes).
- q4 (`qweight` uint8 [N, K / 2]): 4-bit affine, w = q * scale + min, groups of 32 stored in 16
  bytes each: byte j holds element j in its low nibble and element j + 16 in its high one (the
  order of llama.cpp's Q4_0 / Q4_1 blocks). GGUF Q4_0 and Q4_1 fit it.
- k-quant (`qweight` uint8 [N, K / 256 * block bytes], `ggml_type` set, no scales): GGUF's
  Q4_K, Q5_K and Q6_K super-blocks exactly as the file stores them (scales inside the blocks),
  read by kernels/cpu/kquant_linear.py. Kept whole because their per-group scale d * sc is not
  exact in float16: widened to floats they read 6 (Q4_K) and 10 (Q6_K) bits an element
  instead of 4.5 and 6.56.

- bf16 (`qweight` bfloat16 [N, K], no scales): a bf16 checkpoint's weight as stored, under a
  float32 model (kernels/cpu/bf16_linear.py): half the bytes of widening it, the same values.

`scales` (and `mins` for q4, in the same dtype) are [N, K / group], float32 or float16; the
group size is K over their width. GGUF stores its block scales as float16: kept so
(`compact_scales`) they are exact and a quarter of a 4-bit weight's bytes instead of a third.
`dequantize` is the reference every kernel is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

Q4_GROUP = 32  # elements per 4-bit group (the nibble order above is per 32 elements)
KINDS = ("int8", "fp8", "q4", "q4_k", "q5_k", "q6_k", "bf16")
SCALE_DTYPES = (torch.float32, torch.float16)
SUPER_BLOCK = 256  # elements per K-quant super-block
# llama.cpp's type id -> (kind, bytes per super-block of 256)
KQUANTS = {12: ("q4_k", 144), 13: ("q5_k", 176), 14: ("q6_k", 210)}


@dataclass
class QuantizedWeight:
    qweight: torch.Tensor
    scales: torch.Tensor | None
    mins: torch.Tensor | None = None
    ggml_type: int | None = None  # a K-quant: qweight holds GGUF super-blocks as stored

    def __post_init__(self) -> None:
        if self.ggml_type is not None:
            self._check_kquant()
            return
        kind = self.kind  # validates the dtype
        if kind == "bf16":
            if self.qweight.dim() != 2 or self.scales is not None or self.mins is not None:
                raise ValueError("bf16 weights are [N, K] with no scales")
            return
        rows, cols = self.shape
        if self.scales.dim() != 2 or self.scales.shape[0] != rows or self.scales.shape[1] == 0:
            raise ValueError(f"{kind} scales must be [{rows}, groups], not "
                             f"{tuple(self.scales.shape)}")
        if cols % self.scales.shape[1]:
            raise ValueError(f"{kind}: {cols} columns do not split into "
                             f"{self.scales.shape[1]} groups")
        if self.scales.dtype not in SCALE_DTYPES:
            raise ValueError(f"{kind} scales must be float32 or float16, not {self.scales.dtype}")
        if self.mins is not None and self.mins.dtype != self.scales.dtype:
            raise ValueError(f"{kind} mins must be {self.scales.dtype} like the scales")
        if (kind == "q4") != (self.mins is not None):
            raise ValueError("4-bit weights need mins; int8 and fp8 ones have none")
        if kind == "q4" and self.group_size != Q4_GROUP:
            raise ValueError(f"4-bit weights come in groups of {Q4_GROUP}, not {self.group_size}")

    def _check_kquant(self) -> None:
        if self.ggml_type not in KQUANTS:
            raise ValueError(f"ggml type {self.ggml_type} is not a K-quant this layout keeps "
                             f"({sorted(KQUANTS)})")
        kind, block = KQUANTS[self.ggml_type]
        if self.qweight.dtype != torch.uint8 or self.qweight.dim() != 2 \
                or self.qweight.shape[1] % block:
            raise ValueError(f"{kind} blocks must be uint8 [N, a multiple of {block} bytes], not "
                             f"{self.qweight.dtype} {tuple(self.qweight.shape)}")
        if self.scales is not None or self.mins is not None:
            raise ValueError(f"{kind} weights keep their scales inside the blocks")

    @property
    def kind(self) -> str:
        if self.ggml_type is not None:
            return KQUANTS[self.ggml_type][0]
        dtype = self.qweight.dtype
        if dtype == torch.int8:
            return "int8"
        if dtype == torch.float8_e4m3fn:
            return "fp8"
        if dtype == torch.uint8:
            return "q4"
        if dtype == torch.bfloat16:
            return "bf16"
        raise ValueError(f"no quantized layout stores weights as {dtype}")

    @property
    def shape(self) -> torch.Size:
        rows, cols = self.qweight.shape
        if self.ggml_type is not None:
            return torch.Size((rows, cols // KQUANTS[self.ggml_type][1] * SUPER_BLOCK))
        return torch.Size((rows, cols * 2 if self.kind == "q4" else cols))

    @property
    def group_size(self) -> int:
        """Elements a scale covers (K-quants: the super-block, the unit columns split along)."""
        if self.ggml_type is not None:
            return SUPER_BLOCK
        if self.scales is None:  # bf16: every element its own
            return 1
        return self.shape[1] // self.scales.shape[1]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.qweight, self.scales, self.mins) if t is not None)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float [N, K] weight these bytes stand for."""
        if self.ggml_type is not None:
            return kquant_dequantize(self.qweight, self.ggml_type, self.shape[1]).to(dtype)
        if self.scales is None:  # bf16
            return self.qweight.to(dtype)
        if self.kind == "q4":
            q = self.qweight.view(self.shape[0], -1, Q4_GROUP // 2)
            q = torch.cat([q & 0xF, q >> 4], dim=-1).float()  # per group: elements j, j + 16
        else:
            q = self.qweight.float().view(self.shape[0], self.scales.shape[1], -1)
        w = q * self.scales.float().unsqueeze(-1)
        if self.mins is not None:
            w = w + self.mins.float().unsqueeze(-1)
        return w.reshape(self.shape).to(dtype)

    def narrow(self, dim: int, start: int, length: int) -> QuantizedWeight:
        """Rows (dim 0) anywhere; columns (dim 1) only along whole groups (a parallel shard)."""
        kq = self.ggml_type
        if self.scales is None and kq is None:  # bf16: anywhere
            return QuantizedWeight(self.qweight.narrow(dim, start, length), None)
        if dim % 2 == 0:
            if kq is not None:
                return QuantizedWeight(self.qweight.narrow(0, start, length), None, None, kq)
            return QuantizedWeight(
                self.qweight.narrow(0, start, length), self.scales.narrow(0, start, length),
                None if self.mins is None else self.mins.narrow(0, start, length))
        group = self.group_size
        if start % group or length % group:
            raise ValueError(f"a {self.kind} weight in groups of {group} cannot be split at "
                             f"columns [{start}, {start + length})")
        if kq is not None:
            block = KQUANTS[kq][1]
            return QuantizedWeight(self.qweight.narrow(1, start // group * block,
                                                       length // group * block), None, None, kq)
        per_byte = 2 if self.kind == "q4" else 1
        return QuantizedWeight(
            self.qweight.narrow(1, start // per_byte, length // per_byte),
            self.scales.narrow(1, start // group, length // group),
            None if self.mins is None else self.mins.narrow(1, start // group, length // group))

    def take_rows(self, ids: torch.Tensor) -> QuantizedWeight:
        """The rows `ids` (1-D), e.g. an embedding lookup's."""
        if self.scales is None:  # K-quant blocks or bf16 rows
            return QuantizedWeight(self.qweight[ids], None, None, self.ggml_type)
        return QuantizedWeight(self.qweight[ids], self.scales[ids],
                               None if self.mins is None else self.mins[ids])

    def contiguous(self) -> QuantizedWeight:
        if self.scales is None:
            return QuantizedWeight(self.qweight.contiguous(), None, None, self.ggml_type)
        return QuantizedWeight(self.qweight.contiguous(), self.scales.contiguous(),
                               None if self.mins is None else self.mins.contiguous())

    def compact_scales(self) -> QuantizedWeight:
        """The same weight with float16 scales and mins when that loses nothing (GGUF's Q8_0,
        Q4_0 and Q4_1 store them so); otherwise itself."""
        if self.scales is None:
            return self
        parts = [t for t in (self.scales, self.mins) if t is not None]
        if self.scales.dtype == torch.float16 or not all(
                torch.equal(t.half().float(), t) for t in parts):
            return self
        return QuantizedWeight(self.qweight, self.scales.half(),
                               None if self.mins is None else self.mins.half())


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Parts stacked along the output rows (q|k|v, gate|up): they must share layout and groups."""
    first = parts[0]
    for p in parts[1:]:
        if p.kind != first.kind or p.group_size != first.group_size:
            raise ValueError(f"cannot fuse a {p.kind} weight in groups of {p.group_size} with "
                             f"a {first.kind} one in groups of {first.group_size}")
    if first.scales is None:  # K-quant blocks or bf16 rows
        return QuantizedWeight(torch.cat([p.qweight for p in parts]), None, None,
                               first.ggml_type)
    # Scales of different dtypes meet as float32 (exact: float16 widens losslessly).
    dtype = torch.float16 if all(p.scales.dtype == torch.float16 for p in parts) else \
        torch.float32
    mins = None if first.mins is None else torch.cat([p.mins.to(dtype) for p in parts])
    return QuantizedWeight(torch.cat([p.qweight for p in parts]),
                           torch.cat([p.scales.to(dtype) for p in parts]), mins)


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Symmetric per-output-channel int8 of a float [N, K] weight: scale = max |w| / 127."""
    w = w.float()
    scales = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
    q = torch.round(w / scales).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(q.contiguous(), scales.contiguous())


def kquant_dequantize(blocks: torch.Tensor, ggml_type: int, cols: int) -> torch.Tensor:
    """K-quant rows as float32 [N, cols]: the native kernel, else gguf's own numpy code (the
    reference both are held to)."""
    from deepinfer.kernels.cpu import kquant_linear

    if blocks.device.type == "cpu" and kquant_linear.available():
        return kquant_linear.kquant_dequantize(blocks, ggml_type, cols)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rows = dequantize(blocks.cpu().numpy(), GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)).reshape(-1, cols).to(
        blocks.device)
