"""DeepSeek-V4's multi-token-prediction layer as the proposer (`--speculative-method mtp` on a V4
checkpoint).

DeepSeek's V4 checkpoints keep it as `mtp.0.*`: a V4 block (window attention, MoE,
hyper-connections: the block's own weights, named as the decoder layers' are) with its own input
norms (`enorm`, `hnorm`), two projections summed into each residual stream (`e_proj` of the next
token's embedding, `h_proj` of the target's stream), and its own stream collapse and norm
(`hc_head_*`, `norm`) before the target's LM head; the embedding and the head are the target's.
Unlike V3's layer it reads the target's residual streams before their final collapse (the last
decoder layer's output, [hc, hidden] a token) and chains on its own output streams.

Its attention is the sliding window only (DeepSeek's V4 configs give the MTP block compression
ratio 0); it keeps its window K = V rows in the target's full-attention blocks, as V3's MTP keeps
its latents, so a prefix hit finds them and the host tier moves them. What it observes and how it
chains k drafts is MtpProposer's (workers/spec_decode/mtp.py).
"""

from __future__ import annotations

import re

import msgspec
import torch
from torch import nn

from deepinfer.engine.kv_layout import FULL, VECTOR, LayerKVLayout
from deepinfer.engine.model_config import ModelConfig, ModelConfigError
from deepinfer.workers.attention import AttentionBackend, select_backend
from deepinfer.workers.kv_cache import KVCache
from deepinfer.workers.layers.linear import Linear
from deepinfer.workers.layers.norm import RMSNorm
from deepinfer.workers.loader import DTYPES, load_model
from deepinfer.workers.models.deepseek_v4 import (
    DeepseekV4ForCausalLM,
    HyperHead,
    InterleavedRope,
    V4DecoderLayer,
)
from deepinfer.workers.sample.sampler import Sampler
from deepinfer.workers.spec_decode.mtp import MtpProposer

PREFIX = "mtp.0."
# The MTP block's own names (before the decoder layers' renames apply to the rest).
OWN = [(re.compile(a), b) for a, b in [
    (r"^mtp\.0\.hc_head_(fn|base|scale)$", r"mtp.0.hc_head.hc_\1"),
    (r"^mtp\.0\.norm\.weight$", "mtp.0.norm.weight"),
    (r"^mtp\.0\.(e_proj|h_proj|enorm|hnorm)\.weight$", r"mtp.0.\1.weight"),
]]


def mtp_config(cfg: ModelConfig) -> ModelConfig:
    """The target's config with the MTP block as layer `num_layers`: window attention, a
    routed (not hash) MoE."""
    c = cfg.compressed
    return msgspec.structs.replace(
        cfg, compressed=msgspec.structs.replace(c, attention=(*c.attention[: cfg.num_layers],
                                                              "sliding")))


class V4MtpBlock(V4DecoderLayer):
    def __init__(self, cfg: ModelConfig) -> None:
        c = cfg.compressed
        super().__init__(mtp_config(cfg), cfg.num_layers, InterleavedRope(c.rope_main, c.rope_dim),
                         InterleavedRope(c.rope_compress, c.rope_dim))
        hidden = cfg.hidden_size
        self.hidden = hidden
        self.e_proj = Linear(hidden, hidden)
        self.h_proj = Linear(hidden, hidden)
        self.enorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg)
        # Its one cache entry (the window's K = V rows), in the proposer's own cache.
        self.self_attn.entries = {"window": 0}
        self.self_attn.groups = {"window": 0}

    def predict(self, ids: torch.Tensor, streams: torch.Tensor, positions: torch.Tensor,
                caches, metas, embed: nn.Module) -> torch.Tensor:
        """The block's output streams [T, hc, H] at each position, from the target's (or its own
        previous) streams there and the next token."""
        t, hc, h = streams.shape
        e = self.e_proj(self.enorm(embed(ids).contiguous()))
        s = self.h_proj(self.hnorm(streams.reshape(t * hc, h).contiguous())).view(t, hc, h)
        return self(s + e[:, None], ids, positions, caches, metas)

    def head_input(self, streams: torch.Tensor) -> torch.Tensor:
        """What the target's LM head reads: the collapsed, normed streams."""
        return self.norm(self.hc_head(streams).contiguous())


class V4MtpModel(nn.Module):
    """The checkpoint's first MTP block, named as it names it; the target's weights skipped."""

    stacked_params = DeepseekV4ForCausalLM.stacked_params
    expert_params = DeepseekV4ForCausalLM.expert_params
    checkpoint_renames: dict[str, str] = {}

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        self.mtp = nn.ModuleDict({"0": V4MtpBlock(cfg)})

    @staticmethod
    def skips_weight(name: str) -> bool:
        return not name.startswith(PREFIX)

    @staticmethod
    def rename_weight(name: str) -> str:
        for pattern, target in OWN:
            if pattern.match(name):
                return pattern.sub(target, name)
        return DeepseekV4ForCausalLM.rename_weight(name)  # the block's, as the decoder layers'


class V4MtpProposer(MtpProposer):
    def __init__(self, model_dir: str, dtype: str, num_blocks: int, block_size: int,
                 weight_copies: str, sampler: Sampler, target: nn.Module | None) -> None:
        cfg = ModelConfig.from_dir(model_dir)
        kinds = cfg.compressed.attention
        if len(kinds) > cfg.num_layers and kinds[cfg.num_layers] != "sliding":
            raise ModelConfigError(f"{model_dir}: the MTP layer's attention is "
                                   f"{kinds[cfg.num_layers]}; only window attention is served")
        if target is None or not cfg.num_nextn_predict_layers:
            raise ModelConfigError("--speculative-method mtp needs the V4 checkpoint's MTP layer "
                                   f"(num_nextn_predict_layers is {cfg.num_nextn_predict_layers})")
        torch_dtype = DTYPES[dtype]
        self.attention = select_backend("cpu", torch_dtype)
        try:
            model = load_model(model_dir, dtype, weight_copies, self.attention, cls=V4MtpModel)
        except ValueError as exc:  # a checkpoint saved without them (transformers drops them)
            raise ModelConfigError(f"{model_dir} has no usable MTP weights ({PREFIX}*): "
                                   f"{exc}") from None
        self.block: V4MtpBlock = model.mtp["0"]
        self.target = target
        self.block_size = block_size
        self.vocab_size = cfg.vocab_size
        self.sampler = sampler
        self.kv = KVCache([LayerKVLayout(FULL, 1, cfg.head_dim, None, VECTOR, layer=0,
                                         name="window")], num_blocks, block_size, torch_dtype)
        self.last = {}
        # The last decoder layer's output streams of every forward, row for row.
        self.streams: torch.Tensor | None = None
        target.model.layers[-1].register_forward_hook(self._keep_streams)

    def _keep_streams(self, module, args, out: torch.Tensor) -> None:
        self.streams = out

    def target_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.streams

    def _predict(self, ids, hidden, positions, meta) -> torch.Tensor:
        return self.block.predict(ids, hidden, positions, self.kv, [meta],
                                  self.target.model.embed_tokens)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(self.block.head_input(hidden))[:, : self.vocab_size]
