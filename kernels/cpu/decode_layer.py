"""A Llama-family model's decoder layers for decode steps on CPU, in one native call.

At batch 1 the Python between a layer's native ops (module calls, views, checks, one dispatch
each) cost ~0.11 ms a layer, ~3 ms a token next to ~18 ms of weight reads. The `decode_layer`
op (csrc/decode_layer.cpp) runs the same ops (fused norm, small-M or oneDNN linears, rotary +
KV store, paged decode attention, silu·up; GGUF K-quant and bf16 weights through their own
kernels) back to back through the dispatcher: a decode step
at batch 1 / 16 / 64 took ~16 % / 10 % / 3 % less. Calling it once a layer from Python still
parsed its 29 arguments each time; `DecodeStack` holds every layer's weights (given once at
load) and runs all the layers in one call a step. The model's Python layers stay the reference
and the path for everything else (prefill and mixed steps, other devices and dtypes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.kernels.cpu import attention as cpu_attention
from deepinfer.kernels.cpu import bf16_linear as cpu_bf16_linear
from deepinfer.kernels.cpu import fused as cpu_fused
from deepinfer.kernels.cpu import kquant_linear as cpu_kquant_linear
from deepinfer.kernels.cpu import linear as cpu_linear
from deepinfer.kernels.cpu import quant_linear as cpu_quant_linear
from deepinfer.kernels.cpu.native import NativeOp

_OP = NativeOp("decode_layer", "decode_layer.cpp", "decode_layer")

EMPTY = torch.empty(0)  # a weight with no plain copy (only the packed one is kept)
PART_BF16 = 0  # a LinearWeights part that is a bf16 weight (else its ggml type: a K-quant)


@dataclass(frozen=True)
class LinearWeights:
    """One linear as the op reads it: the plain [out, in] weight (read by the small-M kernel up
    to 4 rows; EMPTY when only the packed copy is kept) and the oneDNN-packed one (used above 4
    rows; None: the small-M kernel throughout). A quantized weight (int8, fp8 or 4-bit: plain is
    its qweight, with its scales and mins, workers/quantization/weight.py): the quantized
    small-M kernel takes it, and above 4 rows the integer GEMM when it is int8 in groups of a
    multiple of 32, or 4-bit; `packed` is then the GEMM's pre-packed tiles, if kept."""

    plain: torch.Tensor
    packed: torch.Tensor | None
    bias: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    int_gemm: bool = False  # quantized, and the integer GEMM takes it above 4 rows
    # GGUF K-quant blocks or bf16 weights, as parts side by side (a Q4_K_M file's q, k and v
    # differ in type): each part's kernel at any row count; `plain` is then EMPTY.
    parts: tuple[torch.Tensor, ...] = ()
    part_kinds: tuple[int, ...] = ()  # PART_BF16, or the part's ggml type
    # a part's second copy (a K-quant's lanes, a bf16 weight's strips), or EMPTY
    part_lanes: tuple[torch.Tensor, ...] = ()

    def takes_any_rows(self) -> bool:
        return self.packed is not None or self.int_gemm or bool(self.parts)


@dataclass(frozen=True)
class DecodeLayerWeights:
    """Everything one layer's call needs besides the step's tensors, resolved once at load."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv: LinearWeights  # may carry a bias (Qwen2); the others may not
    o: LinearWeights
    gate_up: LinearWeights
    down: LinearWeights
    num_heads: int
    num_kv_heads: int
    scale: float
    kv_group: int  # which KV group's block tables and key ranges the layer reads

    def takes_any_rows(self) -> bool:
        """True when every linear can take more than 4 rows (a packed copy, or quantized
        weights the integer GEMM takes)."""
        return all(w.takes_any_rows() for w in (self.qkv, self.o, self.gate_up, self.down))


def build_error() -> str | None:
    return _OP.error


def available(*tensors: torch.Tensor | None) -> bool:
    """True when this op and the ops it calls are built and take these tensors."""
    return (cpu_fused.available(*tensors) and cpu_linear.available(*tensors)
            and cpu_attention.available(*tensors) and cpu_quant_linear.available(*tensors)
            and _OP.available(*tensors))


def decode_stack(layers: list[DecodeLayerWeights]) -> torch.ScriptObject:
    """The layers as one native object (csrc/decode_layer.cpp's DecodeStack), their weights
    handed over once: a decode step is then one call (`run_stack`). Call `available` first."""
    _OP.load()
    stack = torch.classes.deepinfer_cpu.DecodeStack()
    for w in layers:
        linears = (w.qkv, w.o, w.gate_up, w.down)
        parts = [(p, kind, i, lanes) for i, lin in enumerate(linears)
                 for p, kind, lanes in zip(lin.parts, lin.part_kinds,
                                           lin.part_lanes or (EMPTY,) * len(lin.parts))]
        if parts:
            cpu_kquant_linear.available()  # the ops the parts call, loaded (built) now
            cpu_bf16_linear.available()
        stack.add_layer(w.input_norm, w.post_norm, w.eps, w.qkv.plain, w.qkv.bias, w.o.plain,
                        w.gate_up.plain, w.down.plain, w.qkv.packed, w.o.packed,
                        w.gate_up.packed, w.down.packed, w.num_heads, w.num_kv_heads, w.scale,
                        w.kv_group, [lin.scales for lin in linears], [lin.mins for lin in linears],
                        [p for p, *_ in parts], [k for _, k, *_ in parts],
                        [i for _, _, i, _ in parts], [lanes for *_, lanes in parts],
                        cpu_kquant_linear.BF16_TILES)
    return stack


def run_stack(stack: torch.ScriptObject, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              positions: torch.Tensor, k_caches: list[torch.Tensor],
              v_caches: list[torch.Tensor], slots: list[torch.Tensor],
              block_tables: list[torch.Tensor], key_lo: list[torch.Tensor],
              key_hi: list[torch.Tensor]) -> torch.Tensor:
    """Every layer for [T, hidden] decode rows x: returns the last layer's output; x (the
    residual stream) is updated in place. Caches one per layer; slots, tables and key ranges
    one per KV group (those of `attention.paged_decode_attention` and `fused.rope_store_kv`)."""
    return stack.forward(x, cos, sin, positions, k_caches, v_caches, slots, block_tables,
                         key_lo, key_hi)
