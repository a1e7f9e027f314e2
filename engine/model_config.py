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

from deepinfer.engine.kv_layout import FULL, LATENT, SLIDING, VECTOR, KVCacheLayout, LayerKVLayout


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
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params["rope_type"] == "yarn":  # it needs the pre-scaling context
        params.setdefault("original_max_position_embeddings",
                          cfg.get("max_position_embeddings", 4096))
    return params


def moe_fields(cfg: dict) -> dict[str, Any]:
    """Mixture-of-experts fields (none for a dense model). Qwen3-MoE may save its expert count
    as `num_local_experts` (Mixtral's name); Mixtral's experts take `intermediate_size`."""
    experts = (cfg.get("num_experts") or cfg.get("num_local_experts")
               or cfg.get("n_routed_experts") or 0)
    if not experts:
        return {}
    return dict(
        num_experts=experts,
        num_experts_per_tok=cfg["num_experts_per_tok"],
        moe_intermediate_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=cfg.get("decoder_sparse_step") or 1,
        mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
    )


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
class CompressedAttention(msgspec.Struct, frozen=True, kw_only=True):
    """DeepSeek-V4's attention and residual settings (every layer: a sliding window of K = V
    entries; CSA layers add compressed entries picked per query by an indexer, HCA layers
    heavily compressed ones)."""

    attention: tuple[str, ...]  # per layer: "sliding", "csa" or "hca"
    window: int  # the attention window of every layer
    csa_rate: int
    hca_rate: int
    rope_dim: int  # trailing dims of each head that get (interleaved) RoPE
    rope_main: dict[str, Any]  # sliding-only layers
    rope_compress: dict[str, Any]  # CSA / HCA layers and their compressors
    o_groups: int
    o_lora_rank: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    hash_layers: tuple[int, ...]  # MoE layers whose experts a token-id table picks
    scoring_func: str
    swiglu_limit: float

    def check_block_size(self, block_size: int) -> None:
        """Compressed entries lie in the block where their window ends: the block size and
        each compression rate must divide one another."""
        rates = ([self.csa_rate] if "csa" in self.attention else []) + (
            [self.hca_rate] if "hca" in self.attention else [])
        for rate in rates:
            if max(rate, block_size) % min(rate, block_size):
                raise ModelConfigError(f"--block-size {block_size} and the compression rate "
                                       f"{rate} must divide one another")

    def source_window(self) -> int:
        """Tokens each layer's sliding entries must keep: the attention window, and what the
        compressors still need of their inputs (two CSA windows, one HCA window)."""
        need = [self.window]
        need += [2 * self.csa_rate] if "csa" in self.attention else []
        need += [self.hca_rate] if "hca" in self.attention else []
        return max(need)


_V4_ATTENTION = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
                 "heavily_compressed_attention": "hca"}


def compressed_attention(cfg: dict) -> CompressedAttention:
    rates = cfg.get("compress_rates") or {}
    rope = cfg.get("rope_parameters") or {}
    head_dim = cfg["head_dim"]
    rope_dim = int(head_dim * (cfg.get("partial_rotary_factor") or 64 / 512))

    def params(kind: str, theta: float) -> dict[str, Any]:
        p = dict(rope.get(kind) or {"rope_type": "default", "rope_theta": theta})
        p["rope_type"] = p.get("rope_type") or p.get("type") or "default"
        if p["rope_type"] == "yarn":
            p.setdefault("original_max_position_embeddings",
                         cfg.get("max_position_embeddings", 4096))
        return p

    n = cfg["num_hidden_layers"]
    mlp = cfg.get("mlp_layer_types") or (["hash_moe"] * 3 + ["moe"] * n)[:n]
    return CompressedAttention(
        attention=tuple(_V4_ATTENTION[t] for t in cfg["layer_types"]),
        window=cfg["sliding_window"],
        csa_rate=rates.get("compressed_sparse_attention", 4),
        hca_rate=rates.get("heavily_compressed_attention", 128),
        rope_dim=rope_dim,
        rope_main=params("main", cfg.get("rope_theta", 10000.0)),
        rope_compress=params("compress", cfg.get("compress_rope_theta", 160000.0)),
        o_groups=cfg["o_groups"],
        o_lora_rank=cfg["o_lora_rank"],
        index_heads=cfg["index_n_heads"],
        index_head_dim=cfg["index_head_dim"],
        index_topk=cfg["index_topk"],
        hc_mult=cfg["hc_mult"],
        hc_sinkhorn_iters=cfg["hc_sinkhorn_iters"],
        hc_eps=float(cfg["hc_eps"]),
        hash_layers=tuple(i for i, t in enumerate(mlp) if t == "hash_moe"),
        scoring_func=cfg.get("scoring_func", "sqrtsoftplus"),
        swiglu_limit=float(cfg.get("swiglu_limit") or 0.0),
    )


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
        from deepinfer.engine.model_registry import ARCHITECTURES, Architecture, architecture_name

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


def checkpoint_quantization(raw: dict) -> dict[str, Any]:
    """The ModelConfig fields for config.json's quantization_config; a scheme DeepInfer cannot
    run is refused by name rather than loaded as garbage."""
    qc = raw.get("quantization_config")
    if not qc:
        return {}
    method = qc.get("quant_method")
    if method != "fp8":
        raise ModelConfigError(f"quantization_config.quant_method {method!r} is not supported "
                               "(DeepInfer reads fp8 checkpoints with block scales and GGUF files)")
    if qc.get("activation_scheme", "dynamic") != "dynamic" or qc.get("fmt", "e4m3") != "e4m3":
        raise ModelConfigError("only fp8 e4m3 checkpoints with dynamic activations are supported")
    block = qc.get("weight_block_size") or (128, 128)
    return {"quantization": "fp8", "fp8_block": (int(block[0]), int(block[1]))}


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
