"""DSpark (`--speculative-method dspark --speculative-model DIR`): a block of drafts from one
parallel forward of a small drafter over the target's chosen layers (workers/spec_decode/
dspark_model.py), drawn one after another through its Markov head, and as many of them verified
as its confidence head expects to be accepted.

- After every step (`observe`) the target's chosen layers' states at every position it computed
  and kept (prefill chunks, decode inputs, accepted drafts; read through forward hooks) become
  the drafter's context rows, whose K/V each draft layer writes in the target's full-attention
  blocks (its own tensors: a prefix hit finds them there, the host and disk tiers move them).
  Rejected drafts were never observed, so nothing of them stays.
- At the next step (`propose`) a request whose context reaches its newest token t_p runs the
  block [t_p, mask, ...] at positions p.. over that context; draft j is drawn from output j's
  logits plus the Markov bias of draft j - 1 (processed like the target's distribution,
  workers/spec_decode/base.py extend_drafts).
- The verified length: the longest prefix whose estimated acceptance (the running product of
  the confidence head's per-draft estimates) stays at or above the threshold, at most the
  scheduler's draft slots; none (the threshold above even the first) counts as finding nothing,
  so the scheduler's back-off applies (engine/spec/policy.py). Threshold 0: every slot is used.
  Whether to verify draft j depends only on the drafts before it, so rejection sampling still
  gives the target's distribution.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from deepinfer.engine.kv_layout import FULL, LayerKVLayout
from deepinfer.engine.model_config import ModelConfig, ModelConfigError
from deepinfer.workers.kv_cache import KVCache
from deepinfer.workers.loader import DTYPES
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
from deepinfer.workers.spec_decode.dspark_model import DSparkConfig, DSparkDrafter

DEFAULT_THRESHOLD = 0.5


class LayerTap:
    """The target's chosen layers' states of the last forward, row for row: [T, width]."""

    def __init__(self, target: nn.Module, cfg: ModelConfig, layer_ids: tuple[int, ...]) -> None:
        model = target.model
        n = len(model.layers)
        if any(i < -1 or i >= n for i in layer_ids):
            raise ModelConfigError(f"DSpark target_layer_ids {list(layer_ids)} are outside the "
                                   f"target's {n} layers (-1: the embedding)")
        # DeepSeek-V4: each layer's state is its residual streams, flattened.
        self.streams = cfg.compressed.hc_mult if cfg.compressed is not None else 0
        self.width = len(layer_ids) * max(self.streams, 1) * cfg.hidden_size
        self.ids = layer_ids
        self.states: dict[int, torch.Tensor] = {}
        for i in set(layer_ids):
            module = model.embed_tokens if i == -1 else model.layers[i]
            module.register_forward_hook(self._hook(i))
        if hasattr(model, "fast_layers"):  # one native call for all layers: no per-layer state
            model.fast_layers = None

    def _hook(self, i: int):
        def keep(module, args, out) -> None:
            if isinstance(out, tuple):  # (x, residual): the layer's output is their sum, now
                x, residual = out  # (the next layer adds x into residual in place)
                out = x if residual is None else x + residual
            if i == -1 and self.streams:  # the embedding enters every stream
                out = out[:, None].expand(-1, self.streams, -1)
            self.states[i] = out.reshape(out.shape[0], -1).clone()
        return keep

    def features(self) -> torch.Tensor:
        return torch.cat([self.states[i] for i in self.ids], dim=-1)


class DSparkProposer(Proposer):
    observes = True

    def __init__(self, drafter_dir: str, target_dir: str, dtype: str, num_blocks: int,
                 block_size: int, sampler: Sampler, target: nn.Module | None,
                 threshold: float | None) -> None:
        target_cfg = ModelConfig.from_dir(target_dir)
        if target is None or not target_cfg.kv_cache_layout().layers_of(FULL):
            raise ModelConfigError("DSpark needs a target with full-attention (or DeepSeek-V4 "
                                   "compressed) layers: its K/V lives in their blocks")
        cfg = DSparkConfig.from_dir(drafter_dir)
        if cfg.vocab != target_cfg.vocab_size:
            raise ModelConfigError(f"the DSpark drafter's vocabulary ({cfg.vocab}) differs from "
                                   f"the target's ({target_cfg.vocab_size})")
        torch_dtype = DTYPES[dtype]
        self.drafter = DSparkDrafter.load(drafter_dir, torch_dtype)
        self.tap = LayerTap(target, target_cfg, cfg.target_layers)
        width = self.tap.width
        if self.drafter.fc.in_features != width:
            raise ModelConfigError(f"the DSpark drafter's fc reads {self.drafter.fc.in_features} "
                                   f"values a token; the target's layers {list(cfg.target_layers)}"
                                   f" give {width}")
        self.cfg = cfg
        self.threshold = (threshold if threshold is not None else cfg.threshold
                          if cfg.threshold is not None else DEFAULT_THRESHOLD)
        self.block_size = block_size
        self.sampler = sampler
        self.kv = KVCache([LayerKVLayout(FULL, cfg.kv_heads, cfg.head_dim)] * cfg.layers,
                          num_blocks, block_size, torch_dtype)
        self.seen: dict[str, int] = {}  # request -> positions below this are in its context
        # Per proposal, the estimated acceptance of each draft made (tests and benchmarks read
        # it: request -> list of running products).
        self.last_confidence: dict[str, list[float]] = {}

    def target_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tap.features()

    # ------------------------------------------------------------------ the proposer seam

    def observe(self, seqs: list[ObservedSeq]) -> None:
        for s in seqs:
            skip = max(0, s.full_kv_from - s.start)  # cached positions: the K/V is there
            n = len(s.tokens) - skip
            if s.full_table is None or n <= 0:
                continue
            start = s.start + skip
            positions = torch.arange(start, start + n)
            ctx = self.drafter.context(s.hidden[skip:].to(self.drafter.fc.weight.dtype))
            slots = self._slots(s.full_table, positions)
            for layer, (k_cache, v_cache) in zip(self.drafter.layers, self.kv):
                k, v = layer.self_attn.keys_values(ctx, positions, self.drafter.rope)
                k_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k)
                v_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v)
            self.seen[s.request_id] = start + n

    def propose(self, step: list[StepInput], requests: list[DraftRequest]) -> list[Draft]:
        drafts = [Draft([], None if r.state.params.is_greedy() else []) for r in requests]
        tables = {s.request_id: s.full_table for s in step}
        live = [(r, d) for r, d in zip(requests, drafts)
                if self.seen.get(r.request_id) == r.start and tables.get(r.request_id) is not None]
        if not live:
            return finish_drafts(drafts)
        n = min(self.cfg.block, max(r.max_drafts for r, _ in live))
        hidden, base = [], []
        for r, _ in live:
            h = self._block(r, tables[r.request_id])[:n]
            hidden.append(h)
            base.append(self.drafter.lm_head(h).float())
        hidden, base = torch.stack(hidden), torch.stack(base)  # [R, n, *]
        prev = torch.tensor([int(r.known_tokens()[-1]) for r, _ in live])
        prevs = []
        for j in range(n):
            prevs.append(prev)
            logits = base[:, j] + self.drafter.markov_bias(prev)
            extend_drafts(self.sampler, [r for r, _ in live], [d for _, d in live], logits)
            prev = torch.tensor([d.tokens[-1] for _, d in live])
        self._choose_lengths(live, hidden, torch.stack(prevs, dim=1))
        return finish_drafts(drafts)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.seen.pop(rid, None)
            self.last_confidence.pop(rid, None)

    # ------------------------------------------------------------------ internals

    def _slots(self, table: np.ndarray, positions: torch.Tensor) -> torch.Tensor:
        blocks = torch.as_tensor(np.asarray(table, dtype=np.int64))
        return blocks[positions // self.block_size] * self.block_size + positions % self.block_size

    def _block(self, r: DraftRequest, table: np.ndarray) -> torch.Tensor:
        """The draft block's outputs [block, hidden] for a request at its newest token."""
        p, size = r.start, self.cfg.block
        ctx_slots = self._slots(table, torch.arange(p))
        ctx = [(k.view(-1, *k.shape[2:])[ctx_slots], v.view(-1, *v.shape[2:])[ctx_slots])
               for k, v in self.kv]
        ids = torch.full((size,), self.cfg.mask_id, dtype=torch.long)
        ids[0] = int(r.known_tokens()[-1])
        return self.drafter.block(ids, torch.arange(p, p + size), ctx)

    def _choose_lengths(self, live: list[tuple[DraftRequest, Draft]], hidden: torch.Tensor,
                        prevs: torch.Tensor) -> None:
        """Cut each request's drafts to its slots and to the prefix the confidence head
        expects to be accepted (with the threshold)."""
        if self.drafter.confidence_head is None:
            for r, d in live:
                del d.tokens[r.max_drafts:]
                if d.probs is not None:
                    del d.probs[r.max_drafts:]
            return
        chance = self.drafter.accept_probability(hidden, prevs).cumprod(dim=-1)  # [R, n]
        for (r, d), row in zip(live, chance.tolist()):
            keep = min(r.max_drafts, sum(1 for c in row if c >= self.threshold)
                       if self.threshold > 0 else len(row))
            self.last_confidence[r.request_id] = row[:keep]
            del d.tokens[keep:]
            if d.probs is not None:
                del d.probs[keep:]
