"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3 with qk-norm).

One flattened batch of tokens [T] per step; attention goes through the paged KV cache and the
attention backend chosen at load. Projections are fused (q|k|v, gate|up) and loaded through
`STACKED_PARAMS`. Steps made only of decodes run each layer as one native call on CPU
(kernels/cpu/decode_layer.py) when every layer fits it; these Python layers are its reference.
Each layer's MLP comes from `build_mlp`: dense here, a mixture of experts in workers/models/moe.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from deepinfer.engine.model_config import ModelConfig, ModelConfigError
from deepinfer.kernels.cpu import decode_layer as cpu_decode_layer
from deepinfer.kernels.cpu import fused as cpu_fused
from deepinfer.kernels.cpu.decode_layer import DecodeLayerWeights
from deepinfer.workers.attention import AttentionBackend, AttentionMetadata
from deepinfer.workers.distributed.parallel_state import tp
from deepinfer.workers.layers import gpu_kernels
from deepinfer.workers.layers.linear import SMALL_M, MergedLinear, RowParallelLinear
from deepinfer.workers.layers.norm import RMSNorm
from deepinfer.workers.layers.rotary import RotaryEmbedding
from deepinfer.workers.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding

# checkpoint name fragment -> (fused module fragment, part)
STACKED_PARAMS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, group: int,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.group = group  # which KV group's metadata (block tables, window) this layer uses
        self.backend = backend
        # Tensor parallelism: this rank's KV heads (split as evenly as their count allows, or
        # one replicated when there are fewer than ranks) and the query heads that read them.
        state = tp()
        kv_start, self.num_kv_heads = state.kv_heads(cfg.num_kv_heads)
        if cfg.num_kv_heads >= state.world:
            group = cfg.num_heads // cfg.num_kv_heads
            q_start, self.num_heads = kv_start * group, self.num_kv_heads * group
        else:
            q_start, self.num_heads = state.shard(cfg.num_heads, "attention heads")
        self.head_dim = d = cfg.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        self.qkv_proj = MergedLinear(cfg.hidden_size, {"q": q, "k": kv, "v": kv},
                                     bias=cfg.qkv_bias,
                                     sources={"q": q_start * d, "k": kv_start * d,
                                              "v": kv_start * d})
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, bias=cfg.o_proj_bias,
                                        shard=(q_start * d, q))
        self.qk_norm = cfg.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
        self.rotary = rotary
        self.scale = (cfg.query_pre_attn_scalar or self.head_dim) ** -0.5
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
        o = self.backend.forward(q, k, v, kv[0], kv[1], meta, self.scale)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        hidden, inter = cfg.hidden_size, intermediate_size or cfg.intermediate_size
        start, part = tp().shard(inter, "intermediate size")  # this rank's columns
        self.gate_up_proj = MergedLinear(hidden, {"gate": part, "up": part}, bias=cfg.mlp_bias,
                                         sources={"gate": start, "up": start})
        self.down_proj = RowParallelLinear(inter, hidden, bias=cfg.mlp_bias)
        if cfg.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ModelConfigError(f"MLP activation {cfg.hidden_act!r} is not supported")
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"  # Gemma's GeGLU
        self._native = self._triton = False  # set by finalize()

    def finalize(self) -> None:
        w = self.gate_up_proj.weight
        self._native = not self.gelu and cpu_fused.available(w)
        self._triton = not self.gelu and gpu_kernels.wanted(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.gelu:
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(torch.nn.functional.gelu(gate, approximate="tanh") * up)
        if self._native and gate_up.is_contiguous():
            return self.down_proj(cpu_fused.silu_and_mul(gate_up))
        if self._triton and gate_up.is_contiguous():
            return self.down_proj(gpu_kernels.silu_and_mul(gate_up))
        return self.down_proj(cpu_fused.silu_and_mul_ref(gate_up))


# (config, layer index) -> that layer's MLP: dense, or a mixture of experts (workers/models/moe.py)
MLPFactory = Callable[[ModelConfig, int], nn.Module]


def dense_mlp(cfg: ModelConfig, layer: int) -> nn.Module:
    return MLP(cfg)


class DecoderLayer(nn.Module):
    attention_class: type[nn.Module] = Attention

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, group: int,
                 backend: AttentionBackend, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention_class(cfg, rotary, group, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

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

    def decode_weights(self) -> DecodeLayerWeights | None:
        """This layer as the one-call decode op reads it, or None when it does not fit the op
        (qk-norm, biases outside q/k/v, no native norm or attention, experts, ...)."""
        attn, mlp = self.self_attn, self.mlp
        if not isinstance(mlp, MLP) or not isinstance(attn, Attention) or tp().world > 1:
            return None  # (the one-call layer has no all-reduce inside)
        norms = (self.input_layernorm, self.post_attention_layernorm)
        linears = [lin.weights() for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                             mlp.down_proj)]
        if (attn.qk_norm or not attn.rotary.native or not attn.backend.native_decode
                or norms[0].eps != norms[1].eps
                or any(n.native_weight is None for n in norms)
                or any(w is None for w in linears)
                or any(w.bias is not None for w in linears[1:])):
            return None
        return DecodeLayerWeights(
            norms[0].native_weight, norms[1].native_weight, norms[0].eps, *linears,
            num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, scale=attn.scale,
            kv_group=attn.group)


class LlamaModel(nn.Module):
    layer_class: type[nn.Module] = DecoderLayer

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend,
                 mlp: MLPFactory = dense_mlp) -> None:
        super().__init__()
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        layout = cfg.kv_cache_layout()
        self.layers = nn.ModuleList(
            self.layer_class(cfg, rotary, layout.group_of(i), backend, mlp(cfg, i))
            for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = rotary
        self.fast_layers: list[DecodeLayerWeights] | None = None  # set by finalize()
        self.fast_stack: torch.ScriptObject | None = None  # ... and as one native object
        self.fast_any_rows = False  # ... and whether they take more than SMALL_M rows

    def finalize(self) -> None:
        """After the layers' own finalize: use the one-call native decode layer when every
        layer fits it."""
        self.fast_layers, self.fast_stack, self.fast_any_rows = None, None, False
        if not cpu_decode_layer.available(self.embed_tokens.weight):
            return
        fast = [layer.decode_weights() for layer in self.layers]
        if all(w is not None for w in fast):
            self.fast_layers = fast
            self.fast_stack = cpu_decode_layer.decode_stack(fast)
            # A linear kept without its packed copy (or a quantized one the integer GEMM does
            # not take) goes to F.linear or dequantized tiles above SMALL_M rows.
            self.fast_any_rows = all(w.takes_any_rows() for w in fast)

    def _fast_path(self, rows: int, metas: list[AttentionMetadata]) -> bool:
        if not self.fast_layers or any(m.decode_rows is None or m.prefills for m in metas):
            return False
        return rows <= SMALL_M or self.fast_any_rows

    def forward(self, input_ids, positions, kv_caches, metas: list[AttentionMetadata]):
        x, residual = self.embed_tokens(input_ids), None
        if self._fast_path(x.shape[0], metas):
            return self._decode_fast(x, positions, kv_caches, metas)
        for layer, kv in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, kv, metas)
        return self.norm(x, residual)

    def _decode_fast(self, x, positions, kv_caches, metas: list[AttentionMetadata]):
        """All rows are decodes: every layer in one native call."""
        rows = x.shape[0]
        out = cpu_decode_layer.run_stack(
            self.fast_stack, x, self.rotary.cos, self.rotary.sin, positions,
            [kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches],
            [m.row_slots for m in metas], [m.decode_blocks.view(rows, -1) for m in metas],
            [m.decode_lo for m in metas], [m.decode_hi for m in metas])
        return self.norm(out, x)  # x: the residual stream, updated in place


class LlamaForCausalLM(nn.Module):
    # Its decode forward can be one CUDA graph (workers/cuda_graphs.py): every layer is this
    # family's attention and dense MLP, with no host work. Subclasses whose layers differ
    # (MLA indexes rows from the host, MoE routing syncs) say False.
    supports_cuda_graphs = True
    stacked_params = STACKED_PARAMS
    checkpoint_renames: dict[str, str] = {}  # name fragment -> ours, applied first
    expert_params: dict[str, str] = {}  # per-expert checkpoint weight -> FusedExperts part
    build_mlp: MLPFactory = staticmethod(dense_mlp)
    model_class: type[nn.Module] = LlamaModel

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        self.model = self.model_class(cfg, backend, self.build_mlp)
        self.tie_word_embeddings = cfg.tie_word_embeddings
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size)

    def forward(self, input_ids, positions, kv_caches, metas: list[AttentionMetadata]
                ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, metas)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def tie_weights(self) -> None:
        if self.tie_word_embeddings:
            embed = self.model.embed_tokens
            if getattr(embed, "quantized", None) is not None:  # one quantized copy for both
                self.lm_head.load_quantized(embed.quantized)
            else:
                self.lm_head.weight.data = embed.weight.data
