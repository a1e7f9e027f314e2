"""A checkpoint's HF config.json, parsed once into one typed ModelConfig.

Every process reads the model through this: the scheduler (KV groups, windows, EOS ids), the
tokenizer (vocabulary), the workers (shapes for building the model). Derived values (head_dim,
per-layer attention kinds, the normalized RoPE parameters, bias conventions of each family)
are worked out here and nowhere else. No torch: the API, tokenizer and scheduler stay light.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import msgspec

from engine.kv_spec import FULL, LATENT, SLIDING, KVCacheSpec, LayerKVSpec


class ModelConfigError(ValueError):
    """The model cannot be served as asked (no such directory, no config.json, an unsupported
    architecture): the user's to fix, reported as one line, never a traceback."""


def layer_kinds(cfg: dict) -> list[str]:
    """Per-layer attention kind ("full" or "sliding") from an HF config.

    `layer_types` (Qwen3, GPT-OSS, Gemma 3 style) wins; otherwise a `sliding_window` applies to
    every layer (Mistral), unless `use_sliding_window` is false (Qwen2/Qwen3 defaults).
    """
    n = cfg["num_hidden_layers"]
    if cfg.get("layer_types"):
        return [SLIDING if "sliding" in t else FULL for t in cfg["layer_types"]]
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
        return [SLIDING] * n
    return [FULL] * n


def rope_parameters(cfg: dict, kind: str = FULL) -> dict[str, Any]:
    """RoPE of one layer kind, normalized from old (rope_theta + rope_scaling) and new
    (rope_parameters) config styles. Gemma 3 has one set per kind: transformers 5 nests them
    under the layer type; older configs give sliding layers `rope_local_base_freq` (and no
    scaling)."""
    params = dict(cfg.get("rope_parameters") or {})
    if f"{kind}_attention" in params:
        params = dict(params[f"{kind}_attention"] or {})
    elif kind == SLIDING and "rope_local_base_freq" in cfg:
        params = {"rope_theta": cfg["rope_local_base_freq"], "rope_type": "default"}
    else:
        params.pop("full_attention", None)
        params.pop("sliding_attention", None)
        scaling = cfg.get("rope_scaling") or {}
        for key, value in scaling.items():
            params.setdefault(key, value)
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if "factor" in params:  # YaRN needs the pre-scaling context
        params.setdefault("original_max_position_embeddings",
                          cfg.get("max_position_embeddings", 4096))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def moe_fields(cfg: dict, model_type: str) -> dict[str, Any]:
    """Mixture-of-experts fields (none for a dense model). Qwen3-MoE may save its expert count
    as `num_local_experts` (Mixtral's name); Mixtral's experts take `intermediate_size` and its
    router always renormalizes the top-k weights."""
    experts = (cfg.get("num_experts") or cfg.get("num_local_experts")
               or cfg.get("n_routed_experts") or 0)
    if not experts:
        return {}
    moe_inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    fields = dict(
        num_experts=experts,
        num_experts_per_tok=cfg["num_experts_per_tok"],
        moe_intermediate_size=moe_inter,
        norm_topk_prob=model_type == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=cfg.get("decoder_sparse_step") or 1,
        mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
    )
    if model_type in DEEPSEEK:
        # Sigmoid scores with a correction bias, top-k within the best groups, scaled; the
        # first layers dense; always-on shared experts without a gate.
        fields.update(
            router="grouped_sigmoid",
            n_group=cfg.get("n_group") or 1,
            topk_group=cfg.get("topk_group") or 1,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
            mlp_only_layers=tuple(range(cfg.get("first_k_dense_replace") or 0)),
            shared_expert_intermediate_size=moe_inter * (cfg.get("n_shared_experts", 1) or 0),
            shared_expert_gated=False,
        )
    return fields


def mla_fields(cfg: dict) -> dict[str, Any]:
    """Multi-head latent attention (DeepSeek-V2/V3): low-rank q, a compressed KV latent."""
    return dict(
        q_lora_rank=cfg.get("q_lora_rank") or 0,
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"],
        qk_rope_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"],
        rope_interleave=bool(cfg.get("rope_interleave", True)),
    )
GEMMA3 = ("gemma3", "gemma3_text")
DEEPSEEK = ("deepseek_v3",)


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

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    def kv_cache_spec(self) -> KVCacheSpec:
        """What each layer keeps per token in the paged KV cache (engine/kv_spec.py)."""
        if self.mla:
            return KVCacheSpec(tuple(
                LayerKVSpec(kind, 1, self.kv_lora_rank, entry=LATENT,
                            rope_dim=self.qk_rope_head_dim)
                for kind in self.layer_kinds))
        return KVCacheSpec(tuple(
            LayerKVSpec(kind, self.num_kv_heads, self.head_dim,
                        self.sliding_window if kind == SLIDING else None)
            for kind in self.layer_kinds))

    @classmethod
    def from_dir(cls, model_dir: str) -> ModelConfig:
        return _load(str(Path(model_dir).resolve()))

    @classmethod
    def from_hf(cls, raw: dict, generation: dict | None = None) -> ModelConfig:
        """From config.json's contents (and generation_config.json's, which may name EOS ids)."""
        cfg = raw.get("text_config", raw)
        model_type = cfg.get("model_type") or raw.get("model_type") or "llama"
        heads = cfg["num_attention_heads"]
        eos = (generation or {}).get("eos_token_id", cfg.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        kinds = tuple(layer_kinds(cfg))
        # Qwen2 has q/k/v biases and no o_proj bias without saying so in its config;
        # Qwen2-MoE says so as `qkv_bias`.
        qwen2 = model_type in ("qwen2", "qwen2_moe")
        qkv_bias = cfg.get("qkv_bias", cfg.get("attention_bias", qwen2))
        gemma = model_type in GEMMA3
        deepseek = model_type in DEEPSEEK
        if cfg.get("attn_logit_softcapping"):
            raise ModelConfigError("attention logit soft-capping is not supported")
        sliding_rope = rope_parameters(cfg, SLIDING) if SLIDING in kinds else None
        full_rope = rope_parameters(cfg, FULL)
        return cls(
            architecture=(raw.get("architectures") or ["LlamaForCausalLM"])[0],
            model_type=model_type,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            # MLA: the rotary part's width (what HF's rotary tables are built for).
            head_dim=(cfg["qk_rope_head_dim"] if deepseek
                      else cfg.get("head_dim") or cfg["hidden_size"] // heads),
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings",
                                             raw.get("tie_word_embeddings", False))),
            qkv_bias=bool(qkv_bias),
            o_proj_bias=bool(cfg.get("attention_bias", False)) and not qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe") or gemma,
            rope=full_rope,
            eos_token_ids=eos_ids,
            layer_kinds=kinds,
            sliding_window=cfg.get("sliding_window") if SLIDING in kinds else None,
            num_nextn_predict_layers=cfg.get("num_nextn_predict_layers", 0) or 0,
            **moe_fields(cfg, model_type),
            rope_sliding=sliding_rope if sliding_rope != full_rope else None,
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if gemma else None,
            embed_scale=cfg["hidden_size"] ** 0.5 if gemma else 1.0,
            norm_offset=1.0 if gemma else 0.0,
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            **(mla_fields(cfg) if deepseek else {}),
        )


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
