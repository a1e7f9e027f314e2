"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3 with qk-norm).

One flattened batch of tokens [T] per step; attention goes through the paged KV cache.
Projections are fused (q|k|v, gate|up) and loaded through `STACKED_PARAMS`.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import SLIDING, layer_kinds
from kernels.cpu import decode_layer as cpu_decode_layer
from kernels.cpu import fused as cpu_fused
from workers.attention.paged import AttentionMetadata, paged_attention
from workers.layers.linear import Linear, MergedLinear
from workers.layers.norm import RMSNorm
from workers.layers.rotary import RotaryEmbedding, rope_parameters

# checkpoint name fragment -> (fused module fragment, part)
STACKED_PARAMS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


class Attention(nn.Module):
    def __init__(self, cfg: dict, rotary: RotaryEmbedding, group: int) -> None:
        super().__init__()
        self.group = group  # which KV group's metadata (block tables, window) this layer uses
        hidden = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads", self.num_heads)
        self.head_dim = cfg.get("head_dim") or hidden // self.num_heads
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = cfg.get("attention_bias", cfg.get("model_type") == "qwen2")
        self.qkv_proj = MergedLinear(hidden, {"q": q, "k": kv, "v": kv}, bias=bias)
        self.o_proj = Linear(q, hidden, bias=cfg.get("attention_bias", False)
                             if cfg.get("model_type") != "qwen2" else False)
        self.qk_norm = cfg.get("model_type") in ("qwen3", "qwen3_moe")
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"])
            self.k_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"])
        self.rotary = rotary
        self.scale = self.head_dim**-0.5
        self._split = (q, kv, kv)

    def forward(self, x, positions, kv: tuple[torch.Tensor, torch.Tensor],
                metas: list[AttentionMetadata]):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self._split, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        meta = metas[self.group]
        self.rotary.apply_and_store(q, k, v, positions, kv[0], kv[1], meta.row_slots)
        o = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        bias = cfg.get("mlp_bias", False)
        self.gate_up_proj = MergedLinear(hidden, {"gate": inter, "up": inter}, bias=bias)
        self.down_proj = Linear(inter, hidden, bias=bias)
        self._native = False  # set by finalize()

    def finalize(self) -> None:
        self._native = cpu_fused.available(self.gate_up_proj.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self._native and gate_up.is_contiguous():
            return self.down_proj(cpu_fused.silu_and_mul(gate_up))
        return self.down_proj(cpu_fused.silu_and_mul_ref(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: dict, rotary: RotaryEmbedding, group: int) -> None:
        super().__init__()
        eps = cfg["rms_norm_eps"]
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.self_attn = Attention(cfg, rotary, group)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, positions, kv, metas):
        """x: the previous layer's output, residual: the stream before it (None at layer 0).
        The residual adds are fused into the norms; returns (output, residual)."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, kv, metas)
        h = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rotary = RotaryEmbedding(head_dim, cfg.get("max_position_embeddings", 4096),
                                 rope_parameters(cfg))
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.embed_tokens.weight.requires_grad_(False)
        kinds = layer_kinds(cfg)
        groups = [k for k in ("full", SLIDING) if k in kinds]  # ModelInfo.kv_groups order
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary, groups.index(kind))
                                    for kind in kinds)
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.rotary = rotary
        self._fast_layers: list[tuple] | None = None  # set by finalize()

    def finalize(self) -> None:
        """After the layers' own finalize: use the one-call native decode layer
        (kernels/cpu_decode_layer.py) when every layer fits it."""
        self._fast_layers = None
        if not cpu_decode_layer.available(self.embed_tokens.weight):
            return
        fast = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if (attn.qk_norm or not self.rotary._native or norms[0].eps != norms[1].eps
                    or any(n._native_weight is None for n in norms)
                    or any(not lin._small_m for lin in linears)
                    or any(lin._b is not None for lin in linears[1:])):
                return
            fast.append((attn.group, norms[0]._native_weight, norms[1]._native_weight,
                         norms[0].eps, attn.qkv_proj._w, attn.qkv_proj._b, attn.o_proj._w,
                         mlp.gate_up_proj._w, mlp.down_proj._w,
                         tuple(lin._packed for lin in linears), self.rotary.cos,
                         self.rotary.sin, attn.num_heads, attn.num_kv_heads, attn.scale))
        self._fast_layers = fast

    def forward(self, input_ids, positions, kv_caches, metas: list[AttentionMetadata]):
        x, residual = self.embed_tokens(input_ids), None
        if self._fast_layers and all(m.decode_rows is not None and not m.prefills for m in metas):
            return self._decode_fast(x, positions, kv_caches, metas)
        for layer, kv in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, kv, metas)
        return self.norm(x, residual)

    def _decode_fast(self, x, positions, kv_caches, metas: list[AttentionMetadata]):
        """All rows are decodes: one native call per layer."""
        tables = [m.decode_blocks.view(x.shape[0], -1) for m in metas]
        residual = x  # layer 0 normalizes x and then adds into it
        for i, ((group, in_norm, post_norm, eps, qkv_w, qkv_b, o_w, gate_up_w, down_w, packed,
                 cos, sin, heads, kv_heads, scale), kv) in enumerate(zip(self._fast_layers,
                                                                         kv_caches)):
            meta = metas[group]
            x = cpu_decode_layer.decode_layer(
                x, residual, in_norm, post_norm, eps, qkv_w, qkv_b, o_w, gate_up_w, down_w,
                packed, cos, sin, positions, kv[0], kv[1], meta.row_slots, tables[group],
                meta.decode_lo, meta.decode_hi, heads, kv_heads, scale, i == 0)
        return self.norm(x, residual)


class LlamaForCausalLM(nn.Module):
    stacked_params = STACKED_PARAMS

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.tie_word_embeddings = cfg.get("tie_word_embeddings", False)
        self.lm_head = Linear(cfg["hidden_size"], cfg["vocab_size"])

    def forward(self, input_ids, positions, kv_caches, metas: list[AttentionMetadata]
                ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, metas)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def tie_weights(self) -> None:
        if self.tie_word_embeddings:
            self.lm_head.weight.data = self.model.embed_tokens.weight.data
