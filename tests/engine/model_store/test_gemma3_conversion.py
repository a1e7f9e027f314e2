"""Gemma 3's GGUF conventions, undone on the way to the Hugging Face layout (fast, no model)."""

from __future__ import annotations

from deepinfer.engine.model_config import FULL, SLIDING, ModelConfig, rope_parameters
from deepinfer.engine.model_store.gguf_config import model_config
from deepinfer.engine.model_store.gguf_tokenizer import _vocabulary_merges
from deepinfer.engine.model_store.gguf_weights import LAYOUTS, hf_name

META = {
    "general.architecture": "gemma3", "gemma3.embedding_length": 64,
    "gemma3.attention.head_count": 4, "gemma3.attention.head_count_kv": 1,
    "gemma3.attention.key_length": 16, "gemma3.feed_forward_length": 96,
    "gemma3.context_length": 512, "gemma3.block_count": 12,
    "gemma3.attention.layer_norm_rms_epsilon": 1e-6, "gemma3.rope.freq_base": 1e6,
    "gemma3.attention.sliding_window": 32, "tokenizer.ggml.tokens": ["a"] * 100,
}


def test_gemma3_config_every_sixth_layer_full_and_two_rope_bases():
    config = model_config(META, {"token_embd.weight"})
    kinds = ModelConfig.from_hf(config).layer_kinds
    assert [i for i, k in enumerate(kinds) if k == FULL] == [5, 11]
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["tie_word_embeddings"]
    assert rope_parameters(config, FULL)["rope_theta"] == 1e6
    assert rope_parameters(config, SLIDING)["rope_theta"] == 10000.0
    parsed = ModelConfig.from_hf(config)
    assert parsed.rope_sliding["rope_theta"] == 10000.0 and parsed.query_pre_attn_scalar == 16
    assert parsed.embed_scale == 8.0 and parsed.norm_offset == 1.0 and parsed.qk_norm


def test_older_gemma3_configs_give_sliding_layers_their_local_base():
    old = {"rope_theta": 1e6, "rope_local_base_freq": 10000.0,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    assert rope_parameters(old, FULL) == {"rope_theta": 1e6, "rope_type": "linear", "factor": 8.0}
    assert rope_parameters(old, SLIDING) == {"rope_theta": 10000.0, "rope_type": "default"}


def test_gemma3_tensor_names():
    layout = LAYOUTS["gemma3"]
    assert hf_name("blk.2.ffn_norm.weight", layout) == (
        "model.layers.2.pre_feedforward_layernorm.weight")
    assert hf_name("blk.2.post_attention_norm.weight", layout) == (
        "model.layers.2.post_attention_layernorm.weight")
    assert hf_name("blk.2.post_ffw_norm.weight", layout) == (
        "model.layers.2.post_feedforward_layernorm.weight")
    assert hf_name("blk.2.attn_k_norm.weight", layout) == "model.layers.2.self_attn.k_norm.weight"
    # Llama's ffn_norm is its pre-MLP norm under another HF name.
    assert hf_name("blk.2.ffn_norm.weight") == "model.layers.2.post_attention_layernorm.weight"
    assert layout.norm_shift == 1.0 and not layout.permuted_qk


def test_vocabulary_merges_follow_file_order_then_longer_left_piece():
    tokens = ["a", "b", "c", "ab", "abc", "bc"]
    vocab = {t: i for i, t in enumerate(tokens)}
    assert _vocabulary_merges(tokens, vocab) == [("a", "b"), ("ab", "c"), ("a", "bc"),
                                                 ("b", "c")]
    assert _vocabulary_merges(["x"], {"x": 0}) == []  # a single character merges nothing
