"""GGUF tensors -> float32 arrays under Hugging Face names, in HF layout.

Two things differ from HF besides quantization: llama.cpp names tensors its own way
(`blk.N.attn_q.weight`), and its converter permutes the rows of each attention head of Q and K
for Llama-family models so that rotary pairs are interleaved (x0,x1),(x2,x3)...; HF's rotary
rotates halves. `unpermute_heads` undoes that, exactly as transformers' GGUF loader does.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
from gguf import GGUFReader, dequantize

from engine.model_store.errors import ModelPrepareError

_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_PER_LAYER = {
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
# Not weights in HF layout: llama3-style rope frequencies live in config.json.
_SKIPPED = {"rope_freqs.weight"}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_TOP_NAME = re.compile(r"(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    m = _LAYER_NAME.match(gguf_name)
    if m and m.group(2) in _PER_LAYER:
        return f"model.layers.{m.group(1)}.{_PER_LAYER[m.group(2)]}.{m.group(3)}"
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


def hf_tensors(reader: GGUFReader, n_heads: int,
               n_kv_heads: int) -> Iterator[tuple[str, np.ndarray]]:
    """Every weight, dequantized to contiguous float32, as (HF name, array), one at a time."""
    for t in reader.tensors:
        if t.name in _SKIPPED:
            continue
        name = hf_name(t.name)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest-first
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
        if ".attn_q." in t.name:
            w = unpermute_heads(w, n_heads)
        elif ".attn_k." in t.name:
            w = unpermute_heads(w, n_kv_heads)
        yield name, np.ascontiguousarray(w)
