"""Gemma 3 (text): the Llama-family decoder with Gemma's conventions.

- "sandwich" norms: each sublayer's output is normalized before it joins the residual stream
  (post-attention and post-feedforward norms), besides the usual pre-norms;
- RMSNorm scales by (1 + w) (folded into the weights at load: workers/layers/norm.py);
- GeGLU MLP (tanh-approximated GELU), token embeddings scaled by sqrt(hidden), q/k norms,
  attention scaled by query_pre_attn_scalar ** -0.5;
- sliding-window and full layers (five to one in the released models), each kind with its own
  RoPE base; the tied 262k-vocabulary head.

Attention, MLP, norms and rotary are the Llama family's modules (and their native CPU ops);
only the layer's wiring differs, so there is no one-call native decode layer for it.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.engine.model_config import SLIDING, ModelConfig
from deepinfer.workers.attention import AttentionBackend, AttentionMetadata
from deepinfer.workers.layers.norm import RMSNorm
from deepinfer.workers.layers.rotary import RotaryEmbedding
from deepinfer.workers.layers.vocab_parallel import VocabParallelEmbedding
from deepinfer.workers.models.llama import Attention, LlamaForCausalLM, MLPFactory, dense_mlp


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, group: int,
                 backend: AttentionBackend, mlp: nn.Module) -> None:
        super().__init__()

        def norm() -> RMSNorm:
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)

        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, rotary, group, backend)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = mlp
        self.post_feedforward_layernorm = norm()

    def forward(self, x, residual, positions, kv, metas):
        """As Llama's layer: x is the previous sublayer's output not yet added to the residual
        stream (None at layer 0 means x is the stream); the adds are fused into the pre-norms."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, positions, kv, metas))
        h = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend,
                 mlp: MLPFactory = dense_mlp) -> None:
        super().__init__()
        full = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope)
        sliding = full if cfg.rope_sliding is None else RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_sliding)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = cfg.embed_scale
        layout = cfg.kv_cache_layout()
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, sliding if kind == SLIDING else full, layout.group_of(i),
                               backend, mlp(cfg, i))
            for i, kind in enumerate(cfg.layer_kinds))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.rotaries = nn.ModuleList([full] if sliding is full else [full, sliding])

    def forward(self, input_ids, positions, kv_caches, metas: list[AttentionMetadata]):
        # The scale in the weights' dtype, as the reference computes it.
        x = self.embed_tokens(input_ids) * torch.tensor(self.embed_scale,
                                                        dtype=self.embed_tokens.weight.dtype)
        residual = None
        for layer, kv in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, kv, metas)
        return self.norm(x, residual)


class Gemma3ForCausalLM(LlamaForCausalLM):
    model_class = Gemma3Model
