"""A GGUF file's tensors as served: quantized matrices stay quantized (QuantizedWeight), the rest
become float32; under Hugging Face names, in HF layout, with the fix-ups of
engine/model_store/gguf_weights.py (Q/K rows un-permuted for Llama, Gemma's norm shift).

Each supported block format maps onto a QuantizedWeight layout whose `dequantize` is bit for bit
`gguf.dequantize` (same float32 products, and x - m is x + (-m)):
- Q8_0: int8 in groups of 32, scale d;
- Q4_0 / Q4_1: 4-bit, scale d, min -8d / m; the 16 bytes of a block are already the q4 order;
- Q4_K, Q5_K, Q6_K: the super-blocks themselves (the k-quant layout), not copied: the tensor is
  a view of the memory-mapped file (copy-on-write, never written), so its pages are the page
  cache's and a warm start reads nothing.
Any other type is refused by name (engine.model_store.gguf_model checks a file up front too).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ReaderTensor

from deepinfer.engine.model_store.errors import ModelPrepareError
from deepinfer.engine.model_store.gguf_config import model_config
from deepinfer.engine.model_store.gguf_index import read_index
from deepinfer.engine.model_store.gguf_model import unsupported_type
from deepinfer.engine.model_store.gguf_weights import _SKIPPED, LAYOUTS, hf_name, unpermute_heads
from deepinfer.workers.quantization.weight import QuantizedWeight

Q = GGMLQuantizationType
# qweight, scales and mins (None but for q4), each with one row per output row.
Parts = tuple[np.ndarray, np.ndarray, np.ndarray | None]
_NIBBLE_SHIFTS = np.array([0, 4], dtype=np.uint8)
_CRUMB_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)


def _fp16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 bytes [..., 2] -> float32 [...]."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _q8_0(blocks: np.ndarray) -> Parts:  # [rows, n, 34]: fp16 d, int8 q[32]
    rows = blocks.shape[0]
    return blocks[..., 2:].view(np.int8).reshape(rows, -1), _fp16(blocks[..., :2]), None


def _q4_0(blocks: np.ndarray) -> Parts:  # [rows, n, 18]: fp16 d, 16 bytes of nibbles
    d = _fp16(blocks[..., :2])
    return blocks[..., 2:].reshape(blocks.shape[0], -1), d, np.float32(-8) * d


def _q4_1(blocks: np.ndarray) -> Parts:  # [rows, n, 20]: fp16 d, fp16 m, 16 bytes of nibbles
    q = blocks[..., 4:].reshape(blocks.shape[0], -1)
    return q, _fp16(blocks[..., :2]), _fp16(blocks[..., 2:4])


_DECODERS: dict[GGMLQuantizationType, Callable[[np.ndarray], Parts]] = {
    Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1,
}
_KQUANTS = {Q.Q4_K, Q.Q5_K, Q.Q6_K}  # kept as stored (weight.py's KQUANTS)
_FLOATS = {Q.F32, Q.F16, Q.BF16}  # with _DECODERS and _KQUANTS: gguf_model.SERVED_TYPES


def _float(t: ReaderTensor, shape: tuple[int, ...]) -> np.ndarray:
    if t.tensor_type == Q.BF16:  # the reader gives its bytes: bf16 is fp32's upper half
        bits = np.ascontiguousarray(t.data).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    return np.array(t.data, dtype=np.float32).reshape(shape)  # a copy: t.data is a read-only map


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.require(array, requirements=["C", "W"]))


def read_tensor(t: ReaderTensor, heads: int | None = None) -> torch.Tensor | QuantizedWeight:
    """One GGUF tensor in HF layout: a matrix in a quantized type as a QuantizedWeight, anything
    else as float32. `heads`: un-permute the rows as llama.cpp's Q/K (gguf_weights.py)."""
    shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest-first
    if t.tensor_type in _FLOATS:
        w = _float(t, shape)
        return _tensor(unpermute_heads(w, heads) if heads else w)
    if t.tensor_type in _KQUANTS:
        rows = np.asarray(t.data).reshape(math.prod(shape[:-1]), -1)  # a view of the map
        if heads and len(shape) == 2:
            rows = unpermute_heads(rows, heads)
        rows = np.require(rows, requirements=["C", "W"])  # a copy only from a read-only map
        weight = QuantizedWeight(torch.from_numpy(rows), None, None, int(t.tensor_type))
        if len(shape) == 2:
            return weight
        w = weight.dequantize().reshape(shape).numpy()
        return _tensor(unpermute_heads(w, heads) if heads else w)
    if t.tensor_type not in _DECODERS:
        raise ModelPrepareError(unsupported_type(t.name, t.tensor_type.name))
    # t.data is uint8 [*shape[:-1], bytes per row], each row whole blocks.
    blocks = np.asarray(t.data).reshape(math.prod(shape[:-1]), -1,
                                        GGML_QUANT_SIZES[t.tensor_type][1])
    q, scales, mins = _DECODERS[t.tensor_type](blocks)
    if heads and len(shape) == 2:  # whole rows move: each row's qweight, scales and mins
        q, scales = unpermute_heads(q, heads), unpermute_heads(scales, heads)
        mins = None if mins is None else unpermute_heads(mins, heads)
    weight = QuantizedWeight(_tensor(q), _tensor(scales), None if mins is None else _tensor(mins))
    if len(shape) == 2:
        return weight.compact_scales()
    # Norms and biases are used as floats (llama.cpp keeps them F32 anyway).
    w = weight.dequantize().reshape(shape).numpy()
    return _tensor(unpermute_heads(w, heads) if heads else w)


def gguf_weights(gguf_path: str) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Every weight of the GGUF as (HF name, tensor), one at a time (the file is memory-mapped
    copy-on-write by gguf_index: K-quant tensors stay views of it; nothing else is kept between
    tensors)."""
    index = read_index(gguf_path)
    meta = index.metadata
    arch = meta["general.architecture"]
    config = model_config(meta, {t.name for t in index.tensors})  # also refuses unknown archs
    layout = LAYOUTS[arch]
    for t in index.tensors:
        if t.name in _SKIPPED:
            continue
        name = hf_name(t.name, layout)
        heads = None
        if layout.permuted_qk and ".attn_q." in t.name:
            heads = config["num_attention_heads"]
        elif layout.permuted_qk and ".attn_k." in t.name:
            heads = config["num_key_value_heads"]
        w = read_tensor(t, heads)
        if layout.norm_shift and name.endswith("norm.weight"):
            w = w - layout.norm_shift  # a norm is float (read_tensor dequantizes 1-D tensors)
        yield name, w
