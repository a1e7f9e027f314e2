"""The architectures DeepInfer serves, one registry entry each: where its model class lives
(workers/models/, imported only by the workers), what its config.json means beyond the fields
every family shares, and what it supports. Adding an architecture is its model file under
workers/models/ and an entry here. No torch.

engine/model_config.py reads this registry (ModelConfig.from_hf adds each family's fields);
the entries parse their configs with engine/model_fields.py, never with model_config, so the
imports run one way."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deepinfer.engine.kv_layout import SLIDING
from deepinfer.engine.model_fields import (
    ModelConfigError,
    compressed_attention,
    mla_fields,
    moe_fields,
)

__all__ = ["Architecture", "ARCHITECTURES", "architecture", "architecture_name",
           "tensor_parallel_architectures"]

Fields = Callable[[dict], dict[str, Any]]


@dataclass(frozen=True)
class Architecture:
    model_class: str  # "module:class" under deepinfer.workers.models
    model_types: tuple[str, ...] = ()  # config.json's model_type (names it without architectures)
    fields: Fields = lambda cfg: {}  # ModelConfig fields of this family, from its HF config
    tensor_parallel: bool = False  # its attention and MLP shard over --tensor-parallel-size
    mtp: bool = False  # its multi-token-prediction layers can draft (--speculative-method mtp)


def _qwen2(cfg: dict) -> dict[str, Any]:
    """q/k/v biases and no o_proj bias, without the config saying so (Qwen2-MoE says it as
    `qkv_bias`)."""
    return {"qkv_bias": bool(cfg.get("qkv_bias", cfg.get("attention_bias", True))),
            "o_proj_bias": False}


def _qwen3(cfg: dict) -> dict[str, Any]:
    return {"qk_norm": True}


def _mixtral(cfg: dict) -> dict[str, Any]:
    """Its router always renormalizes the top-k weights."""
    return {"norm_topk_prob": True}


def _gemma3(cfg: dict) -> dict[str, Any]:
    """q/k norms, scores scaled by query_pre_attn_scalar, embeddings by sqrt(hidden), RMSNorm
    by (1 + weight)."""
    return {"qk_norm": True, "query_pre_attn_scalar": cfg.get("query_pre_attn_scalar"),
            "embed_scale": cfg["hidden_size"] ** 0.5, "norm_offset": 1.0}


def _deepseek_moe(cfg: dict, router: str) -> dict[str, Any]:
    """Sigmoid-style routing (`router`), the first layers dense, always-on shared experts
    without a gate."""
    if not moe_fields(cfg):
        return {}
    moe_inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    return dict(
        router=router,
        n_group=cfg.get("n_group") or 1,
        topk_group=cfg.get("topk_group") or 1,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        mlp_only_layers=tuple(range(cfg.get("first_k_dense_replace") or 0)),
        shared_expert_intermediate_size=moe_inter * (cfg.get("n_shared_experts", 1) or 0),
        shared_expert_gated=False,
    )


def _deepseek_v3(cfg: dict) -> dict[str, Any]:
    """Multi-head latent attention (head_dim: the rotary part's width, what HF's rotary tables
    are built for); top-k within the best expert groups, with a correction bias."""
    return {"head_dim": cfg["qk_rope_head_dim"], **mla_fields(cfg),
            **_deepseek_moe(cfg, "grouped_sigmoid")}


def _deepseek_v4(cfg: dict) -> dict[str, Any]:
    """Compressed attention: every layer has a window (and keeps its inputs in it); no expert
    groups, its own scoring and hash-routed layers (workers/models/deepseek_v4.py)."""
    compressed = compressed_attention(cfg)
    return {"compressed": compressed, "q_lora_rank": cfg["q_lora_rank"],
            "layer_kinds": (SLIDING,) * cfg["num_hidden_layers"],
            "sliding_window": compressed.source_window(), **_deepseek_moe(cfg, "v4")}


_LLAMA = "deepinfer.workers.models.llama:LlamaForCausalLM"
_MOE = "deepinfer.workers.models.moe:MoeForCausalLM"

ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(_LLAMA, ("llama",), tensor_parallel=True),
    "MistralForCausalLM": Architecture(_LLAMA, ("mistral",), tensor_parallel=True),
    "Qwen2ForCausalLM": Architecture(_LLAMA, ("qwen2",), _qwen2, tensor_parallel=True),
    "Qwen3ForCausalLM": Architecture(_LLAMA, ("qwen3",), _qwen3, tensor_parallel=True),
    "MixtralForCausalLM": Architecture(_MOE, ("mixtral",), _mixtral, tensor_parallel=True),
    "Qwen2MoeForCausalLM": Architecture(_MOE, ("qwen2_moe",), _qwen2, tensor_parallel=True),
    "Qwen3MoeForCausalLM": Architecture(_MOE, ("qwen3_moe",), _qwen3, tensor_parallel=True),
    "Gemma3ForCausalLM": Architecture("deepinfer.workers.models.gemma3:Gemma3ForCausalLM",
                                      ("gemma3", "gemma3_text"), _gemma3),
    "DeepseekV3ForCausalLM": Architecture(
        "deepinfer.workers.models.deepseek_v3:DeepseekV3ForCausalLM", ("deepseek_v3",),
        _deepseek_v3, mtp=True),
    "DeepseekV4ForCausalLM": Architecture(
        "deepinfer.workers.models.deepseek_v4:DeepseekV4ForCausalLM", ("deepseek_v4",),
        _deepseek_v4, mtp=True),
}


def architecture(name: str) -> Architecture:
    """The registry entry of an HF `architectures` name; ModelConfigError if unsupported."""
    entry = ARCHITECTURES.get(name)
    if entry is None:
        raise ModelConfigError(f"architecture {name!r} is not supported "
                               f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return entry


def architecture_name(raw: dict, model_type: str) -> str:
    """config.json's architecture: its `architectures` entry, else the one its model_type
    names, else Llama's."""
    if raw.get("architectures"):
        return raw["architectures"][0]
    return next((name for name, entry in ARCHITECTURES.items()
                 if model_type in entry.model_types), "LlamaForCausalLM")


def tensor_parallel_architectures() -> list[str]:
    return [name for name, entry in ARCHITECTURES.items() if entry.tensor_parallel]
