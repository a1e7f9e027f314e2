"""A checkpoint's HF config.json, parsed once into one typed ModelConfig.

Every process reads the model through this: the scheduler (KV groups, windows, EOS ids), the
tokenizer (vocabulary), the workers (shapes for building the model). Derived values (head_dim,
per-layer attention kinds, the normalized RoPE parameters, bias conventions of each family)
are worked out here, from the parts engine/model_fields.py parses and the family's entry in
engine/model_registry.py, and nowhere else. No torch: the API, tokenizer and scheduler stay
light.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import msgspec

from deepinfer.engine.kv_layout import FULL, LATENT, SLIDING, VECTOR, KVCacheLayout, LayerKVLayout
from deepinfer.engine.model_fields import (
    CompressedAttention,
    ModelConfigError,
    checkpoint_quantization,
    layer_kinds,
    moe_fields,
    rope_parameters,
)
from deepinfer.engine.model_registry import ARCHITECTURES, Architecture, architecture_name


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What every process needs to know about a checkpoint, with no torch."""

    architecture: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: dict[str, Any]
    eos_token_ids: tuple[int, ...]
    layer_kinds: tuple[str, ...]
    sliding_window: int | None = None
    num_nextn_predict_layers: int = 0  # multi-token-prediction layers (DeepSeek-V3 MTP)
    # Mixture of experts (Qwen3-MoE, Qwen2-MoE, Mixtral); no experts: every layer dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # per expert
    norm_topk_prob: bool = False  # renormalize the top-k router weights to sum to 1
    decoder_sparse_step: int = 1  # every n-th layer has experts ...
    mlp_only_layers: tuple[int, ...] = ()  # ... except these dense ones
    shared_expert_intermediate_size: int = 0  # always-on shared expert(s) (0: none)
    shared_expert_gated: bool = True  # Qwen2-MoE gates it with a sigmoid; DeepSeek does not
    router: str = "softmax"  # softmax top-k, or grouped_sigmoid (DeepSeek-V3)
    n_group: int = 1  # grouped_sigmoid: experts fall into n_group groups ...
    topk_group: int = 1  # ... of which the best topk_group are searched for the top k
    routed_scaling_factor: float = 1.0  # routed experts' weights are multiplied by this
    # Multi-head latent attention (DeepSeek); kv_lora_rank 0: ordinary attention.
    q_lora_rank: int = 0  # 0: q is one projection; else down to this rank, normed, up
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the checkpoint's rotary dims are interleaved pairs
    compressed: CompressedAttention | None = None  # DeepSeek-V4

    def is_moe_layer(self, layer: int) -> bool:
        """Whether this layer's MLP is a sparse MoE block (the HF rule) rather than dense."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)
    # RoPE of sliding-window layers when it differs from `rope` (Gemma 3), else None.
    rope_sliding: dict[str, Any] | None = None
    hidden_act: str = "silu"  # the gated MLP's activation: silu or gelu_pytorch_tanh
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5 (Gemma) or head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    embed_scale: float = 1.0  # token embeddings are multiplied by this (Gemma: sqrt(hidden))
    norm_offset: float = 0.0  # RMSNorm scales by (offset + weight) (Gemma: 1)
    final_logit_softcapping: float | None = None
    # How the checkpoint's own weights are quantized (config.json quantization_config): None
    # (float) or "fp8" (e4m3 with block scales, DeepSeek-V3's `weight_scale_inv`, in blocks of
    # fp8_block rows x columns). A GGUF's types are read from the file itself.
    quantization: str | None = None
    fp8_block: tuple[int, int] = (128, 128)

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    def kv_cache_layout(self, block_size: int = 16) -> KVCacheLayout:
        """What each layer keeps per token in the paged KV cache (engine/kv_layout.py). Only
        DeepSeek-V4's compressed entries depend on the block size (their width per slot)."""
        if self.compressed is not None:
            return KVCacheLayout(v4_cache_entries(self, block_size))
        if self.mla:
            return KVCacheLayout(tuple(
                LayerKVLayout(kind, 1, self.kv_lora_rank, entry=LATENT,
                            rope_dim=self.qk_rope_head_dim)
                for kind in self.layer_kinds))
        return KVCacheLayout(tuple(
            LayerKVLayout(kind, self.num_kv_heads, self.head_dim,
                        self.sliding_window if kind == SLIDING else None)
            for kind in self.layer_kinds))

    @classmethod
    def from_dir(cls, model_dir: str) -> ModelConfig:
        return _load(str(Path(model_dir).resolve()))

    @classmethod
    def from_hf(cls, raw: dict, generation: dict | None = None) -> ModelConfig:
        """From config.json's contents (and generation_config.json's, which may name EOS ids):
        the fields every family shares, then its registry entry's (engine/model_registry.py)."""
        cfg = raw.get("text_config", raw)
        if cfg.get("attn_logit_softcapping"):
            raise ModelConfigError("attention logit soft-capping is not supported")
        heads = cfg["num_attention_heads"]
        eos = (generation or {}).get("eos_token_id", cfg.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        kinds = tuple(layer_kinds(cfg))
        model_type = cfg.get("model_type") or raw.get("model_type") or "llama"
        architecture = architecture_name(raw, model_type)
        fields: dict[str, Any] = dict(
            architecture=architecture,
            model_type=model_type,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size") or cfg["moe_intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings",
                                             raw.get("tie_word_embeddings", False))),
            qkv_bias=bool(cfg.get("qkv_bias", cfg.get("attention_bias", False))),
            o_proj_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=False,
            rope=rope_parameters(cfg, FULL),
            eos_token_ids=eos_ids,
            layer_kinds=kinds,
            sliding_window=cfg.get("sliding_window") if SLIDING in kinds else None,
            num_nextn_predict_layers=cfg.get("num_nextn_predict_layers", 0) or 0,
            **moe_fields(cfg),
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            **checkpoint_quantization(raw),
        )
        fields.update(ARCHITECTURES.get(architecture, Architecture("")).fields(cfg))
        if SLIDING in fields["layer_kinds"]:  # RoPE of the sliding layers, where it differs
            sliding_rope = rope_parameters(cfg, SLIDING)
            if sliding_rope != fields["rope"]:
                fields["rope_sliding"] = sliding_rope
        return cls(**fields)


def v4_cache_entries(cfg: ModelConfig, block_size: int) -> tuple[LayerKVLayout, ...]:
    """DeepSeek-V4's entries per layer. Sliding ones (the same window W, the most any of them
    needs): the K = V window and the compressors' per-token inputs (kv | gate). Full ones: the
    compressed entries and indexer keys, one per window of `rate` tokens, stored spread over the
    last min(rate, block) token slots of their window, so an entry always lies in the block
    where its window ends (a prefix hit never shares a block whose entry is still open)."""
    c, d = cfg.compressed, cfg.head_dim
    w = c.source_window()
    entries = []
    def slot(width: int, rate: int) -> int:  # an entry's floats per token slot
        return width // min(rate, block_size)

    def add(layer: int, name: str, kind: str, width: int) -> None:
        entries.append(LayerKVLayout(kind, 1, width, w if kind == SLIDING else None, VECTOR,
                                   layer=layer, name=name))

    for i, kind in enumerate(c.attention):
        add(i, "window", SLIDING, d)
        if kind == "csa":
            add(i, "source", SLIDING, 4 * d)  # kv and gate of the two overlapping series
            add(i, "compressed", FULL, slot(d, c.csa_rate))
            add(i, "index_source", SLIDING, 4 * c.index_head_dim)
            add(i, "index_keys", FULL, slot(c.index_head_dim, c.csa_rate))
        elif kind == "hca":
            add(i, "source", SLIDING, 2 * d)
            add(i, "compressed", FULL, slot(d, c.hca_rate))
    return tuple(entries)


@functools.lru_cache(maxsize=8)
def _load(model_dir: str) -> ModelConfig:
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelConfigError(f"model directory {model_dir} does not exist")
    config_file = path / "config.json"
    if not config_file.exists():
        raise ModelConfigError(f"{model_dir} has no config.json (not a Hugging Face model "
                               "directory)")
    try:
        raw = json.loads(config_file.read_text())
        gen_file = path / "generation_config.json"
        generation = json.loads(gen_file.read_text()) if gen_file.exists() else None
        return ModelConfig.from_hf(raw, generation)
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelConfigError(f"{config_file} cannot be read: {type(exc).__name__}: {exc}"
                               ) from None
