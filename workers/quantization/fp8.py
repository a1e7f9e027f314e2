"""FP8 (e4m3) weights with block scales, as DeepSeek-V3/V4 checkpoints ship them.

A checkpoint stores `X.weight` in float8_e4m3fn and `X.weight_scale_inv` [ceil(N / bn),
ceil(K / bk)] with w = fp8 * scale_inv per bn x bk block (128 x 128). Held here as groups of bk
along K with the scales repeated per row (workers/quantization/weight.py), which is what the
kernels read; a K that does not split into whole blocks cannot be, and is dequantized instead.
"""

from __future__ import annotations

import torch

from deepinfer.workers.quantization.weight import QuantizedWeight

FP8_MAX = 448.0  # largest finite e4m3fn


def from_checkpoint(weight: torch.Tensor, scale_inv: torch.Tensor,
                    block: tuple[int, int]) -> QuantizedWeight | torch.Tensor:
    """The checkpoint's fp8 weight and block scales: a QuantizedWeight, or the float32 weight
    when its columns do not split into whole blocks of block[1]."""
    rows, cols = weight.shape
    scales = scale_inv.float().repeat_interleave(block[0], dim=0)[:rows]
    if cols % scales.shape[1] or cols // scales.shape[1] % 16:
        expanded = scales.repeat_interleave(block[1], dim=1)[:, :cols]
        return weight.float() * expanded
    return QuantizedWeight(weight.contiguous(), scales.contiguous())


def quantize_fp8(w: torch.Tensor, block: tuple[int, int] = (128, 128)
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A float [N, K] weight as a checkpoint would store it: (fp8 weight, scale_inv per block),
    scale = max |w| / 448 over each block."""
    rows, cols = w.shape
    bn, bk = block
    pad = torch.zeros(-(-rows // bn) * bn, -(-cols // bk) * bk)
    pad[:rows, :cols] = w.float()
    blocks = pad.view(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).view(pad.shape)[:rows, :cols]
    return q.to(torch.float8_e4m3fn).contiguous(), scale


def quantize_fp8_weight(w: torch.Tensor, block: tuple[int, int] = (128, 128)
                        ) -> QuantizedWeight | torch.Tensor:
    """--quantization fp8 on a float checkpoint: quantized at load as a checkpoint would be."""
    return from_checkpoint(*quantize_fp8(w, block), block)
