"""A whole Llama-family decoder layer for decode steps on CPU, in one native call.

At batch 1 the Python between a layer's native ops (module calls, views, checks, one dispatch
each) cost ~0.11 ms a layer, ~3 ms a token next to ~18 ms of weight reads. `decode_layer`
(csrc/decode_layer.cpp) runs the same ops (fused norm, small-M or oneDNN linears, rotary + KV
store, paged decode attention, silu·up) back to back through the dispatcher: a decode step at
batch 1 / 16 / 64 takes ~16 % / 10 % / 3 % less. The model's Python layers stay the reference
and the path for everything else (prefill and mixed steps, other devices and dtypes).
"""

from __future__ import annotations

import torch

from kernels.cpu import attention as cpu_attention
from kernels.cpu import fused as cpu_fused
from kernels.cpu import linear as cpu_linear
from kernels.cpu.native import NativeOp

_OP = NativeOp("decode_layer", "decode_layer.cpp", "decode_layer")


def build_error() -> str | None:
    return _OP.error


def available(*tensors: torch.Tensor | None) -> bool:
    """True when this op and the ops it calls are built and take these tensors."""
    return (cpu_fused.available(*tensors) and cpu_linear.available(*tensors)
            and cpu_attention.available(*tensors) and _OP.available(*tensors))


def decode_layer(x: torch.Tensor, residual: torch.Tensor, input_norm: torch.Tensor,
                 post_norm: torch.Tensor, eps: float, qkv_weight: torch.Tensor,
                 qkv_bias: torch.Tensor | None, o_weight: torch.Tensor,
                 gate_up_weight: torch.Tensor, down_weight: torch.Tensor,
                 packed: tuple[torch.Tensor | None, ...], cos: torch.Tensor,
                 sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                 key_lo: torch.Tensor, key_hi: torch.Tensor, num_heads: int, num_kv_heads: int,
                 scale: float, first_layer: bool) -> torch.Tensor:
    """One layer for [T, hidden] decode rows: returns its output; `residual` (x itself at layer
    0) is updated in place. Weights are the plain [out, in] ones (read by the small-M kernel up
    to 4 rows) and `packed`, the oneDNN-packed qkv, o, gate_up, down (used above 4 rows; None:
    the small-M kernel throughout). The attention arguments are those of
    `cpu_attention.paged_decode_attention`, the rotary ones of `rope_store_kv`."""
    return _OP(x, residual, input_norm, post_norm, eps, qkv_weight, qkv_bias, o_weight,
               gate_up_weight, down_weight, *packed, cos, sin, positions, k_cache, v_cache,
               slots, block_tables, key_lo, key_hi, num_heads, num_kv_heads, scale, first_layer)
