"""A DSpark drafter (DeepSpec's block-parallel draft model), as its checkpoints lay it out.

A drafter directory holds a config.json (a Qwen3-style decoder config plus DSpark's fields:
`target_layer_ids`, `block_size`, `mask_token_id`, `markov_rank`, `markov_head_type`,
`enable_confidence_head`, `confidence_head_with_markov`) and safetensors named as DeepSpec saves
them: `fc`, `hidden_norm`, `layers.{i}.*` (Qwen3 attention with q/k norms, SwiGLU MLP), `norm`,
its own `embed_tokens` and `lm_head` (copies of the target's), `markov_head.markov_w1`
(vocab x rank) and `markov_w2` (rank -> vocab), `confidence_head.proj`.

- Context: the target's hidden states at the chosen layers (`target_layer_ids`, -1 the
  embedding), concatenated per token, through `fc` and `hidden_norm`; every draft layer's k/v
  projections read it (K/V of the context positions are cached, in the proposer).
- Draft block: the newest known token t_p then `block_size - 1` mask tokens at positions
  p..p+block_size-1; each layer's queries see the whole context before p and the whole block
  (no causal mask inside it); output j predicts t_{p+j+1}.
- Markov head: output j's logits plus markov_w2(markov_w1(previous token)) (t_p, then the draft
  before it), so drafts are drawn one after another over logits computed in one pass.
- Confidence head: sigmoid(proj([output j, markov_w1(previous token)])) estimates whether draft
  j is accepted given the ones before; their running product, the chance a prefix is accepted.
For a DeepSeek-V4 target (DeepSpec publishes no V4 drafter; the closest faithful layout) a
chosen layer's hidden state is its residual streams, flattened ([hc * hidden] a token): `fc`'s
input width says which.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.engine.model_config import ModelConfigError
from deepinfer.engine.model_fields import rope_parameters
from deepinfer.workers.layers.rotary import inverse_frequencies


@dataclass(frozen=True)
class DSparkConfig:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    eps: float
    vocab: int
    block: int
    mask_id: int
    target_layers: tuple[int, ...]
    markov_rank: int
    confidence: bool
    confidence_with_markov: bool
    rope: dict
    bias: bool
    threshold: float | None  # the checkpoint's suggested confidence threshold, if any

    @classmethod
    def from_dir(cls, path: str) -> DSparkConfig:
        file = Path(path) / "config.json"
        try:
            raw = json.loads(file.read_text())
            heads = raw["num_attention_heads"]
            markov = str(raw.get("markov_head_type", "vanilla")).lower()
            if int(raw["markov_rank"]) > 0 and markov != "vanilla":
                raise ModelConfigError(f"{path}: markov_head_type {markov!r} is not served "
                                       "(only DeepSpec's vanilla head)")
            if any(t == "sliding_attention" for t in raw.get("layer_types") or []):
                raise ModelConfigError(f"{path}: sliding-window draft layers are not served")
            return cls(
                hidden=raw["hidden_size"], heads=heads,
                kv_heads=raw.get("num_key_value_heads") or heads,
                head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
                intermediate=raw["intermediate_size"], layers=raw["num_hidden_layers"],
                eps=raw.get("rms_norm_eps", 1e-6), vocab=raw["vocab_size"],
                block=int(raw["block_size"]), mask_id=int(raw["mask_token_id"]),
                target_layers=tuple(int(i) for i in raw["target_layer_ids"]),
                markov_rank=int(raw["markov_rank"]),
                confidence=bool(raw.get("enable_confidence_head", False)),
                confidence_with_markov=bool(raw.get("confidence_head_with_markov", False)),
                rope=rope_parameters(raw), bias=bool(raw.get("attention_bias", False)),
                threshold=raw.get("confidence_threshold"))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelConfigError(f"--speculative-model {path} is not a DSpark drafter "
                                   f"({type(exc).__name__}: {exc})") from None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Rope(nn.Module):
    """Rotate-half RoPE (the Qwen3 convention) over the whole head."""

    def __init__(self, params: dict, dim: int) -> None:
        super().__init__()
        inv, self.scale = inverse_frequencies(params, dim)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] at positions [T]."""
        freqs = positions.float()[:, None] * self.inv_freq[None]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        cos, sin = emb.cos() * self.scale, emb.sin() * self.scale
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        h, d = cfg.hidden, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, d
        self.q_proj = nn.Linear(h, cfg.heads * d, bias=cfg.bias)
        self.k_proj = nn.Linear(h, cfg.kv_heads * d, bias=cfg.bias)
        self.v_proj = nn.Linear(h, cfg.kv_heads * d, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.heads * d, h, bias=cfg.bias)
        self.q_norm = Norm(d, cfg.eps)
        self.k_norm = Norm(d, cfg.eps)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor, rope: Rope
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed, rotated) and V of rows x [T, hidden]: [T, kv_heads, D] each."""
        t = x.shape[0]
        k = self.k_norm(self.k_proj(x).view(t, self.kv_heads, self.head_dim))
        return rope(k, positions), self.v_proj(x).view(t, self.kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: Rope,
                ctx_k: torch.Tensor, ctx_v: torch.Tensor) -> torch.Tensor:
        """The block's rows x [n, hidden] over the context's K/V and the whole block."""
        n = x.shape[0]
        q = rope(self.q_norm(self.q_proj(x).view(n, self.heads, self.head_dim)), positions)
        k, v = self.keys_values(x, positions, rope)
        k, v = torch.cat([ctx_k, k]), torch.cat([ctx_v, v])
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                             v.transpose(0, 1), scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(0, 1).reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = Norm(cfg.hidden, cfg.eps)
        self.post_attention_layernorm = Norm(cfg.hidden, cfg.eps)

    def forward(self, x, positions, rope, ctx_k, ctx_v):
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, ctx_k, ctx_v)
        return x + self.mlp(self.post_attention_layernorm(x))


class Markov(nn.Module):
    def __init__(self, cfg: DSparkConfig, bias: bool) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(cfg.vocab, cfg.markov_rank)
        self.markov_w2 = nn.Linear(cfg.markov_rank, cfg.vocab, bias=bias)


class Confidence(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 1)


class DSparkDrafter(nn.Module):
    def __init__(self, cfg: DSparkConfig, context_width: int, markov_bias: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.layers))
        self.norm = Norm(cfg.hidden, cfg.eps)
        self.fc = nn.Linear(context_width, cfg.hidden, bias=False)
        self.hidden_norm = Norm(cfg.hidden, cfg.eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.markov_head = Markov(cfg, markov_bias) if cfg.markov_rank > 0 else None
        self.confidence_head = None
        if cfg.confidence:
            extra = cfg.markov_rank if cfg.confidence_with_markov else 0
            self.confidence_head = Confidence(cfg.hidden + extra)
        self.rope = Rope(cfg.rope, cfg.head_dim)

    @classmethod
    def load(cls, path: str, dtype: torch.dtype) -> DSparkDrafter:
        from safetensors.torch import load_file

        cfg = DSparkConfig.from_dir(path)
        weights: dict[str, torch.Tensor] = {}
        for file in sorted(Path(path).glob("*.safetensors")):
            weights.update(load_file(str(file)))
        weights = {k.removeprefix("model."): v for k, v in weights.items()}
        if "fc.weight" not in weights:
            raise ModelConfigError(f"--speculative-model {path} has no DSpark weights (fc)")
        drafter = cls(cfg, weights["fc.weight"].shape[1], "markov_head.markov_w2.bias" in weights)
        missing, unexpected = drafter.load_state_dict(weights, strict=False)
        if missing or unexpected:
            raise ModelConfigError(f"--speculative-model {path}: weights missing {missing[:4]} "
                                   f"or unexpected {unexpected[:4]}")
        return drafter.to(dtype).eval().requires_grad_(False)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """The target's chosen layers' states [T, width] -> the context rows [T, hidden]."""
        return self.hidden_norm(self.fc(features))

    def block(self, ids: torch.Tensor, positions: torch.Tensor,
              ctx: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One request's draft block [n] over its context (each layer's cached K, V): the normed
        outputs [n, hidden]."""
        x = self.embed_tokens(ids)
        for layer, (k, v) in zip(self.layers, ctx):
            x = layer(x, positions, self.rope, k, v)
        return self.norm(x)

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor | float:
        if self.markov_head is None:
            return 0.0
        return self.markov_head.markov_w2(self.markov_head.markov_w1(prev))

    def accept_probability(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Each output's estimated chance that its draft is accepted after the ones before."""
        features = hidden
        if self.cfg.confidence_with_markov:
            features = torch.cat([hidden, self.markov_head.markov_w1(prev).to(hidden.dtype)], -1)
        return torch.sigmoid(self.confidence_head.proj(features).squeeze(-1).float())
