"""Mixture-of-experts Llama-family decoders: Qwen3-MoE, Qwen2-MoE (with a shared expert), Mixtral;
the MoE block DeepSeek-V3 uses too (grouped sigmoid routing, ungated shared experts).

The attention and decoder layers are Llama's; a layer's MLP is a sparse MoE block where the
config says so (`ModelConfig.is_moe_layer`), dense elsewhere. MoE layers do not fit the
one-call native decode layer, so these models run the Python layers (with the native ops that
apply) on every step.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.engine.model_config import ModelConfig
from deepinfer.workers.layers.linear import Linear
from deepinfer.workers.layers.moe import FusedExperts, route, route_grouped
from deepinfer.workers.models.llama import MLP, LlamaForCausalLM

# per-expert checkpoint names (Qwen: gate/up/down_proj, Mixtral: w1/w3/w2) -> FusedExperts part
EXPERT_PARAMS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down",
                 "w1": "gate", "w3": "up", "w2": "down"}


class Router(Linear):
    """The router's logits; DeepSeek-V3's also carries the bias that steers expert choice."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.num_experts)
        self.cfg = cfg
        if cfg.router == "grouped_sigmoid":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts),
                                                        requires_grad=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        if cfg.router == "grouped_sigmoid":
            return route_grouped(self(x), self.e_score_correction_bias, cfg.num_experts_per_tok,
                                 cfg.n_group, cfg.topk_group, cfg.norm_topk_prob,
                                 cfg.routed_scaling_factor)
        return route(self(x), cfg.num_experts_per_tok, cfg.norm_topk_prob)


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = FusedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: Linear | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, cfg.shared_expert_intermediate_size)
            if cfg.shared_expert_gated:
                self.shared_expert_gate = Linear(cfg.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate.route(x)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out += shared
        return out


def moe_or_dense_mlp(cfg: ModelConfig, layer: int) -> nn.Module:
    return SparseMoeBlock(cfg) if cfg.is_moe_layer(layer) else MLP(cfg)


class MoeForCausalLM(LlamaForCausalLM):
    supports_cuda_graphs = False  # routing syncs with the host
    checkpoint_renames = {".block_sparse_moe.": ".mlp."}  # Mixtral's name for the MoE block
    expert_params = EXPERT_PARAMS
    build_mlp = staticmethod(moe_or_dense_mlp)
