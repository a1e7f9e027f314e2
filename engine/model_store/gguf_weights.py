"""GGUF tensors -> float32 arrays under Hugging Face names, in HF layout.

Besides quantization, llama.cpp's converter changes three things per architecture, undone here:
- it names tensors its own way (`blk.N.attn_q.weight`);
- for Llama-family models it permutes the rows of each attention head of Q and K so that rotary
  pairs are interleaved (x0,x1),(x2,x3)...; HF's rotary rotates halves (`unpermute_heads`, as
  transformers' GGUF loader does);
- for Gemma it stores every RMSNorm weight as 1 + w (llama.cpp scales by the weight; Gemma's
  reference by 1 + w): the 1 is taken off again.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from gguf import GGUFReader, dequantize

from deepinfer.engine.model_store.errors import ModelPrepareError

_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3: a norm after each sublayer as well; llama.cpp's ffn_norm is the pre-MLP norm.
_GEMMA3_LAYER = {
    **_LLAMA_LAYER,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}


@dataclass(frozen=True)
class Layout:
    per_layer: dict[str, str]  # llama.cpp tensor kind -> HF module path inside a layer
    permuted_qk: bool  # Q/K rows interleaved for llama.cpp's rotary
    norm_shift: float  # added to every norm weight by llama.cpp's converter


LAYOUTS = {
    "llama": Layout(_LLAMA_LAYER, permuted_qk=True, norm_shift=0.0),
    "gemma3": Layout(_GEMMA3_LAYER, permuted_qk=False, norm_shift=1.0),
}
# Not weights in HF layout: llama3-style rope frequencies live in config.json.
_SKIPPED = {"rope_freqs.weight"}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_TOP_NAME = re.compile(r"(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str, layout: Layout = LAYOUTS["llama"]) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    m = _LAYER_NAME.match(gguf_name)
    if m and m.group(2) in layout.per_layer:
        return f"model.layers.{m.group(1)}.{layout.per_layer[m.group(2)]}.{m.group(3)}"
    m = _TOP_NAME.match(gguf_name)
    if m and m.group(1) in _TOP_LEVEL:
        return f"{_TOP_LEVEL[m.group(1)]}.{m.group(2)}"
    raise ModelPrepareError(f"GGUF tensor {gguf_name!r} has no known Hugging Face name")


def unpermute_heads(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's `permute` of Q/K rows: per head, (pair, half) -> (half, pair)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensor_count(reader: GGUFReader) -> int:
    return sum(1 for t in reader.tensors if t.name not in _SKIPPED)


def hf_tensors(reader: GGUFReader, arch: str, n_heads: int,
               n_kv_heads: int) -> Iterator[tuple[str, np.ndarray]]:
    """Every weight, dequantized to contiguous float32, as (HF name, array), one at a time."""
    layout = LAYOUTS[arch]
    for t in reader.tensors:
        if t.name in _SKIPPED:
            continue
        name = hf_name(t.name, layout)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest-first
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
        if layout.permuted_qk and ".attn_q." in t.name:
            w = unpermute_heads(w, n_heads)
        elif layout.permuted_qk and ".attn_k." in t.name:
            w = unpermute_heads(w, n_kv_heads)
        elif layout.norm_shift and name.endswith("norm.weight"):
            w = w - np.float32(layout.norm_shift)
        yield name, np.ascontiguousarray(w)
