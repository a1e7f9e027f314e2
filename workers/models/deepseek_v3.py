"""DeepSeek-V3 (and V2-style MLA models): multi-head latent attention, then dense MLPs in the first
layers and mixture-of-experts blocks after (grouped sigmoid routing, shared experts).

- Attention: q through a low-rank bottleneck (q_a_proj, norm, q_b_proj) or one projection; the
  keys and values through one compressed latent per token (kv_a_proj_with_mqa, norm) plus one
  rotary key shared by the heads. The paged cache keeps only those (workers/attention/mla.py).
- RoPE on the rope part only; checkpoints interleave its dimensions in pairs (`rope_interleave`),
  which `after_load` turns into the rotate-half layout by permuting the projection rows: the
  dot products are unchanged, and the Llama family's rotary op applies.
- YaRN scaling multiplies the softmax scale by mscale(factor, mscale_all_dim)^2.
- MTP layers (`num_nextn_predict_layers`) sit in the checkpoint after the decoder layers; the
  target skips them, and the `mtp` proposer (workers/spec_decode/mtp.py) loads them.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from deepinfer.engine.model_config import ModelConfig
from deepinfer.workers.attention import AttentionBackend, AttentionMetadata
from deepinfer.workers.attention.mla import mla_attention
from deepinfer.workers.layers.linear import Linear, PlainWeight
from deepinfer.workers.layers.norm import RMSNorm
from deepinfer.workers.layers.rotary import RotaryEmbedding, yarn_mscale
from deepinfer.workers.models.llama import DecoderLayer, LlamaForCausalLM, LlamaModel
from deepinfer.workers.models.moe import EXPERT_PARAMS, moe_or_dense_mlp

LAYER = re.compile(r"model\.layers\.(\d+)\.")


def deinterleave(weight: torch.Tensor, offset: int, width: int, stride: int) -> None:
    """Reorder rows [offset, offset + width) of every `stride`-row block from pairs
    (x0, x1), (x2, x3).. to (x0, x2, .., x1, x3, ..), in place."""
    order = torch.cat([torch.arange(0, width, 2), torch.arange(1, width, 2)])
    view = weight.view(-1, stride, *weight.shape[1:])
    view[:, offset: offset + width] = view[:, offset: offset + width][:, order]


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, group: int,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.group = group
        self.num_heads = heads = cfg.num_heads
        self.nope, self.rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_head_dim, self.latent = cfg.v_head_dim, cfg.kv_lora_rank
        self.interleaved = cfg.rope_interleave
        qk = self.nope + self.rope
        bias = cfg.o_proj_bias
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = Linear(cfg.q_lora_rank, heads * qk)
        else:
            self.q_proj = Linear(cfg.hidden_size, heads * qk)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, self.latent + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.latent)
        self.kv_b_proj = PlainWeight(self.latent, heads * (self.nope + self.v_head_dim))
        self.o_proj = Linear(heads * self.v_head_dim, cfg.hidden_size, bias=bias)
        self.rotary = rotary
        self.scale = qk ** -0.5
        rope = cfg.rope
        if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
            self.scale *= yarn_mscale(float(rope["factor"]), rope["mscale_all_dim"]) ** 2

    def after_load(self) -> None:
        if not self.interleaved:
            return
        q = self.q_b_proj if hasattr(self, "q_b_proj") else self.q_proj
        deinterleave(q.weight.data, self.nope, self.rope, self.nope + self.rope)
        kv_a = self.kv_a_proj_with_mqa
        for t in (kv_a.weight, kv_a.bias):
            if t is not None:
                deinterleave(t.data, self.latent, self.rope, self.latent + self.rope)

    def forward(self, x, positions, kv: tuple[torch.Tensor, torch.Tensor],
                metas: list[AttentionMetadata]):
        t = x.shape[0]
        if hasattr(self, "q_b_proj"):
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(t, self.num_heads, self.nope + self.rope)
        q_nope, q_rope = q[..., : self.nope], q[..., self.nope:].contiguous()
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.latent, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous()).view(t, 1, self.latent)
        k_rope = k_rope.contiguous().view(t, 1, self.rope)
        meta = metas[self.group]
        # Rotates q_rope and k_rope, then caches (k_rope, latent) at the step's slots.
        self.rotary.apply_and_store(q_rope, k_rope, latent, positions, kv[0], kv[1],
                                    meta.row_slots)
        o = mla_attention(q_nope, q_rope, kv[0], kv[1], meta, self.kv_b_proj.weight,
                          self.v_head_dim, self.scale)
        return self.o_proj(o.reshape(t, self.num_heads * self.v_head_dim))


class DeepseekV3DecoderLayer(DecoderLayer):
    attention_class = MLAttention  # (not the one-call native decode layer's kind)


class DeepseekV3Model(LlamaModel):
    layer_class = DeepseekV3DecoderLayer


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    supports_cuda_graphs = False  # MLA indexes its decode rows from the host; MoE routing syncs
    stacked_params = {"gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}
    checkpoint_renames = {".shared_experts.": ".shared_expert."}
    expert_params = EXPERT_PARAMS
    build_mlp = staticmethod(moe_or_dense_mlp)
    model_class = DeepseekV3Model

    def skips_weight(self, name: str) -> bool:
        """MTP layers follow the decoder layers in the checkpoint: the proposer's, not ours."""
        layer = LAYER.match(name)
        return layer is not None and int(layer[1]) >= self.config.num_layers
