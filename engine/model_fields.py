"""Parts of a checkpoint's HF config.json, each parsed into ModelConfig fields: layer kinds,
RoPE, experts, latent attention, DeepSeek-V4's compressed attention, quantization.

Imports run one way: engine/model_config.py builds ModelConfig from these (the fields every
family shares) and from the family's entry in engine/model_registry.py, whose entries parse
their own parts with these too; this module imports neither. No torch.
"""

from __future__ import annotations

from typing import Any

import msgspec

from deepinfer.engine.kv_layout import FULL, SLIDING


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
