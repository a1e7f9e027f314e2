"""GGUF -> HF conversion, on a tiny synthetic GGUF (exact weights, config, tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer as HFTokenizer

from deepinfer.engine.config import ModelConfig
from deepinfer.engine.model_store.convert import convert_gguf
from deepinfer.engine.model_store.errors import ModelPrepareError
from deepinfer.engine.model_store.gguf_tokenizer import build_tokenizer
from deepinfer.engine.model_store.gguf_weights import hf_name
from deepinfer.engine.tokenizer.tokenizer import Tokenizer
from tests.engine.model_store import tiny_gguf


def _convert(tmp_path: Path, tied: bool) -> tuple[Path, dict[str, np.ndarray]]:
    expected = tiny_gguf.write_tiny_gguf(tmp_path / "tiny.gguf", tied=tied)
    out = tmp_path / "out"
    out.mkdir()
    convert_gguf(tmp_path / "tiny.gguf", out, progress=False)
    return out, expected


@pytest.mark.parametrize("tied", [True, False])
def test_weights_are_exact_in_hf_layout(tmp_path, tied):
    out, expected = _convert(tmp_path, tied)
    got = load_file(str(out / "model.safetensors"))
    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        assert got[name].dtype == np.float32 and got[name].shape == want.shape, name
        assert np.array_equal(got[name], want), name  # Q/K un-permuted, dequantized exactly
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied


def test_config_and_generation_config(tmp_path):
    out, _ = _convert(tmp_path, tied=True)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (
        tiny_gguf.HIDDEN, tiny_gguf.FFN, tiny_gguf.LAYERS)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (
        tiny_gguf.HEADS, tiny_gguf.KV_HEADS)
    assert config["head_dim"] == tiny_gguf.HEAD_DIM
    assert config["rope_parameters"]["rope_theta"] == config["rope_theta"] == 50000.0
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    assert config["vocab_size"] == len(tiny_gguf.vocabulary()[0])
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2
    info = ModelConfig.from_dir(str(out))
    assert (info.num_layers, info.num_kv_heads, info.head_dim, info.eos_token_ids) == (
        tiny_gguf.LAYERS, tiny_gguf.KV_HEADS, tiny_gguf.HEAD_DIM, (2,))


def test_tokenizer_files(tmp_path):
    out, _ = _convert(tmp_path, tied=True)
    hf = HFTokenizer.from_file(str(out / "tokenizer.json"))
    enc = hf.encode("hello world<|im_end|> hi")
    assert enc.tokens == ["hello", "Ġworld", "<|im_end|>", "Ġ", "h", "i"]
    assert hf.decode(enc.ids, skip_special_tokens=False) == "hello world<|im_end|> hi"
    assert hf.decode(enc.ids) == "hello world hi"  # control tokens are special
    assert hf.encode("héllo ✓").ids and hf.decode(hf.encode("héllo ✓").ids) == "héllo ✓"
    tok = Tokenizer(str(out))  # what the engine reads: special tokens and the chat template
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (out / "chat_template.jinja").read_text() == tiny_gguf.TEMPLATE
    text, ids = tok.encode_chat([{"role": "user", "content": "hello"}])
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert ids[:1] == [1] and 2 in ids


def test_names_map_to_hf():
    assert hf_name("blk.7.attn_k.weight") == "model.layers.7.self_attn.k_proj.weight"
    assert hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(ModelPrepareError, match="blk.0.ssm_a"):
        hf_name("blk.0.ssm_a.weight")


def test_unsupported_tokenizer_and_architecture_are_one_line_errors(tmp_path):
    tokens, _ = tiny_gguf.vocabulary()
    with pytest.raises(ModelPrepareError, match="'llama'.*cannot be converted yet"):
        build_tokenizer({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens})
    from deepinfer.engine.model_store.gguf_config import model_config

    with pytest.raises(ModelPrepareError, match="architecture 'mamba'"):
        model_config({"general.architecture": "mamba"}, set())
