"""DeepSeek multi-token prediction (MTP) layers as the speculative proposer (`--speculative-method
mtp`).

An MTP layer predicts the token after next: at position i it takes the target's final hidden
state h_i and the embedding of the next token t_{i+1}, normalizes both, projects their
concatenation back to the hidden size and runs one decoder layer (MLA + MoE, its own KV cache)
and a shared head over it: logits for t_{i+2}. The checkpoint stores it as the decoder layers
after the last one (`model.layers.{num_hidden_layers + k}`), with its own embedding and head.

- After every step (`observe`) the layer runs over every position the target computed and kept
  (prefill chunks, decode inputs, accepted drafts) with the token after each, writing its K/V
  in the target's full-attention blocks (its own tensors; a prefix hit finds them there, written
  by the request that filled the blocks) and keeping its output at the request's last position.
- At the next step (`propose`) that output gives the first draft; further drafts run the same
  layer on its own previous output and draft, one position on (as vLLM chains one MTP layer).
Checkpoints with several MTP layers chain the first only.
"""

from __future__ import annotations

import re

import msgspec
import numpy as np
import torch
from torch import nn

from deepinfer.engine.model_config import FULL, ModelConfig, ModelConfigError
from deepinfer.engine.model_registry import ARCHITECTURES
from deepinfer.workers.attention import AttentionBackend, SeqSlice, select_backend
from deepinfer.workers.kv_cache import KVCache
from deepinfer.workers.layers.linear import Linear
from deepinfer.workers.layers.norm import RMSNorm
from deepinfer.workers.layers.rotary import RotaryEmbedding
from deepinfer.workers.loader import DTYPES, load_model
from deepinfer.workers.models.deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3ForCausalLM
from deepinfer.workers.models.moe import moe_or_dense_mlp
from deepinfer.workers.sample.sampler import Sampler
from deepinfer.workers.spec_decode.base import (
    Draft,
    DraftRequest,
    ObservedSeq,
    Proposer,
    StepInput,
    extend_drafts,
    finish_drafts,
)

LAYER = re.compile(r"model\.layers\.(\d+)\.")


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = Linear(cfg.hidden_size, cfg.vocab_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(hidden.contiguous())).float()


class MtpLayer(DeepseekV3DecoderLayer):
    """A decoder layer with the MTP input projection and its own embedding and head."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 layer: int) -> None:
        super().__init__(cfg, rotary, 0, backend, moe_or_dense_mlp(cfg, layer))
        hidden = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, hidden)
        self.embed_tokens.weight.requires_grad_(False)
        self.enorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * hidden, hidden)
        self.shared_head = SharedHead(cfg)

    def predict(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                kv, metas) -> torch.Tensor:
        """The layer's output hidden state at each position (before the shared head)."""
        x = self.eh_proj(torch.cat([self.enorm(self.embed_tokens(ids)),
                                    self.hnorm(hidden.contiguous())], dim=-1))
        out, residual = self(x, None, positions, kv, metas)
        return out + residual


class MtpModel(nn.Module):
    """The checkpoint's MTP layers, named as it names them; the target's weights are skipped."""

    stacked_params = DeepseekV3ForCausalLM.stacked_params
    checkpoint_renames = DeepseekV3ForCausalLM.checkpoint_renames
    expert_params = DeepseekV3ForCausalLM.expert_params

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope)
        first = cfg.num_layers
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({
            str(i): MtpLayer(cfg, rotary, backend, i)
            for i in range(first, first + cfg.num_nextn_predict_layers)})
        self.rotary = rotary

    def skips_weight(self, name: str) -> bool:
        layer = LAYER.match(name)
        return layer is None or int(layer[1]) < self.config.num_layers

    @property
    def first(self) -> MtpLayer:
        return self.model.layers[str(self.config.num_layers)]


class MtpProposer(Proposer):
    observes = True

    def __init__(self, model_dir: str, dtype: str, num_blocks: int, block_size: int,
                 weight_copies: str, sampler: Sampler) -> None:
        cfg = ModelConfig.from_dir(model_dir)
        supported = [name for name, entry in ARCHITECTURES.items() if entry.mtp]
        if cfg.architecture not in supported or not cfg.num_nextn_predict_layers:
            raise ModelConfigError(
                "--speculative-method mtp needs a model with multi-token-prediction layers "
                f"(supported: {', '.join(supported)} with num_nextn_predict_layers "
                f"> 0; this is {cfg.architecture} with {cfg.num_nextn_predict_layers})")
        torch_dtype = DTYPES[dtype]
        attention = select_backend("cpu", torch_dtype)
        try:
            model = load_model(model_dir, dtype, weight_copies, attention, cls=MtpModel)
        except ValueError as exc:  # a checkpoint exported without them (HF drops them)
            raise ModelConfigError(f"{model_dir} has no usable MTP weights "
                                   f"(model.layers.{cfg.num_layers}.*): {exc}") from None
        self.layer = model.first
        self.attention = attention
        self.block_size = block_size
        self.vocab_size = cfg.vocab_size
        self.sampler = sampler
        # Its one layer's cache, shaped as the target's first layer, in the model's dtype; it
        # lives in the target's full-attention blocks (the host tier copies it with them).
        entry = msgspec.structs.replace(cfg.kv_cache_layout(block_size).layers[0], kind=FULL,
                                        window=None)
        self.kv = KVCache([entry], num_blocks, block_size, torch_dtype)
        # request -> (position, the layer's output there): where the next draft starts
        self.last: dict[str, tuple[int, torch.Tensor]] = {}

    # ------------------------------------------------------------------ the proposer seam

    def observe(self, seqs: list[ObservedSeq]) -> None:
        rows = []
        for s in seqs:
            skip = max(0, s.full_kv_from - s.start)  # cached positions: the K/V is there
            n = len(s.tokens) - skip
            if s.full_table is None or n <= 0 or s.next_token is None:
                continue
            ids = np.append(s.tokens[skip + 1:], s.next_token).astype(np.int64)
            rows.append((s.request_id, s.full_table, s.start + skip, ids, s.hidden[skip:]))
        if not rows:
            return
        out = self._forward(rows)
        end = 0
        for rid, _, start, ids, _ in rows:
            end += len(ids)
            self.last[rid] = (start + len(ids) - 1, out[end - 1])

    def propose(self, step: list[StepInput], requests: list[DraftRequest]) -> list[Draft]:
        drafts = [Draft([], None if r.state.params.is_greedy() else []) for r in requests]
        tables = {s.request_id: s.full_table for s in step}
        # Requests whose last observed position is just before their input token.
        live = [(r, d) for r, d in zip(requests, drafts)
                if self.last.get(r.request_id, (None,))[0] == r.start - 1]
        if not live:
            return finish_drafts(drafts)
        hidden = torch.stack([self.last[r.request_id][1] for r, _ in live])
        for j in range(max(r.max_drafts for r, _ in live)):
            if j:  # one position on: the layer's own output and the previous draft
                hidden = self._forward([(r.request_id, tables[r.request_id], r.start + j - 1,
                                         np.asarray([d.tokens[-1]], np.int64), h[None])
                                        for (r, d), h in zip(live, hidden)])
            logits = self._logits(hidden)
            extend_drafts(self.sampler, [r for r, _ in live], [d for _, d in live], logits)
            keep = [i for i, (r, d) in enumerate(live) if len(d.tokens) < r.max_drafts]
            live, hidden = [live[i] for i in keep], hidden[keep]
            if not live:
                break
        return finish_drafts(drafts)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.last.pop(rid, None)

    # ------------------------------------------------------------------ internals

    def _forward(self, rows: list[tuple[str, np.ndarray, int, np.ndarray, torch.Tensor]]
                 ) -> torch.Tensor:
        """rows: (request, full-attention table, first position, next tokens, target hidden)."""
        slices = [SeqSlice(table, start, len(ids), write_from=start)
                  for _, table, start, ids, _ in rows]
        meta = self.attention.build_metadata(slices, self.block_size, None)
        ids = torch.from_numpy(np.concatenate([r[3] for r in rows]))
        pos = torch.from_numpy(np.concatenate(
            [np.arange(start, start + len(i)) for _, _, start, i, _ in rows]).astype(np.int64))
        return self._predict(ids, torch.cat([r[4] for r in rows]), pos, meta)

    def _predict(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                 meta) -> torch.Tensor:
        """The layer's output at each row, writing its K/V at the rows' slots."""
        return self.layer.predict(ids, hidden, positions, self.kv[0], [meta])

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.layer.shared_head(hidden)[:, : self.vocab_size]
