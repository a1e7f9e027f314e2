"""config.json and generation_config.json for a GGUF model, as transformers writes them.

Llama and Gemma 3 are mapped; another architecture is another entry in `_ARCHITECTURES` (and its
tensor layout in gguf_weights.py).
"""

from __future__ import annotations

from typing import Any

from deepinfer.engine.model_store.errors import ModelPrepareError

# GGUF general.architecture -> (HF architectures entry, HF model_type)
_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"),
                  "gemma3": ("Gemma3ForCausalLM", "gemma3_text")}
# What a Gemma 3 GGUF leaves out, as llama.cpp assumes it: every sixth layer attends to the
# whole context (the others to a sliding window) and sliding layers use RoPE base 10000.
GEMMA3_FULL_EVERY = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0


def model_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    arch = meta["general.architecture"]
    if arch not in _ARCHITECTURES:
        raise ModelPrepareError(
            f"GGUF architecture {arch!r} cannot be converted yet (known: {sorted(_ARCHITECTURES)})")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ModelPrepareError(f"GGUF rope scaling {scaling!r} cannot be converted yet")
    hf_arch, model_type = _ARCHITECTURES[arch]
    hidden = meta[f"{arch}.embedding_length"]
    heads = meta[f"{arch}.attention.head_count"]
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    config = {
        "architectures": [hf_arch],
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "attention_dropout": 0.0,
        **token_ids(meta),
        "dtype": "float32",
        "head_dim": meta.get(f"{arch}.attention.key_length") or hidden // heads,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": meta[f"{arch}.feed_forward_length"],
        "max_position_embeddings": meta[f"{arch}.context_length"],
        "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
        "model_type": model_type,
        "num_attention_heads": heads,
        "num_hidden_layers": meta[f"{arch}.block_count"],
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
        "pretraining_tp": 1,
        "rms_norm_eps": float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        # Both spellings: transformers >= 5 reads rope_parameters, older ones rope_theta.
        "rope_parameters": {"rope_theta": theta, "rope_type": "default"},
        "rope_theta": theta,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "use_cache": True,
        "vocab_size": vocab,
    }
    if arch == "gemma3":
        config.update(_gemma3(meta, config))
    return config


def _gemma3(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    layers, theta = config["num_hidden_layers"], config["rope_theta"]
    local = {"rope_theta": GEMMA3_LOCAL_ROPE_THETA, "rope_type": "default"}
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": ["full_attention" if (i + 1) % GEMMA3_FULL_EVERY == 0
                        else "sliding_attention" for i in range(layers)],
        "sliding_window": meta["gemma3.attention.sliding_window"],
        # Scores scaled by head_dim ** -0.5, as llama.cpp does for every size but 27B.
        "query_pre_attn_scalar": config["head_dim"],
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_THETA,
        "rope_parameters": {"full_attention": {"rope_theta": theta, "rope_type": "default"},
                            "sliding_attention": local},
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }


def token_ids(meta: dict[str, Any]) -> dict[str, int]:
    keys = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id",
            "pad_token_id": "padding_token_id", "unk_token_id": "unknown_token_id"}
    return {hf: meta[f"tokenizer.ggml.{g}"] for hf, g in keys.items()
            if f"tokenizer.ggml.{g}" in meta}


def generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    ids = token_ids(meta)
    ids.pop("unk_token_id", None)
    return {"_from_model_config": True, **ids}
