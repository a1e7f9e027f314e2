"""A separate, smaller draft model that shares the target's tokenizer.

Its KV cache has its own tensors but the target's block tables (the full-attention group's): the
scheduler reserves the slots, and both models write the same positions. Every step the draft
model first computes K/V for whatever the target computes (prefill chunks, decode inputs) plus
anything it has not seen yet (the last draft of a fully accepted run, which it proposed but
never read); then it proposes autoregressively: k - 1 more one-token steps for the speculating
requests. A prefix-cache hit finds the draft's K/V in the same blocks as the target's, written
by the request that filled them; host-tier copies move the draft's blocks along.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from deepinfer.engine.model_config import FULL, ModelConfig, ModelConfigError
from deepinfer.workers.attention import SeqSlice, select_backend
from deepinfer.workers.kv_cache import KVCache
from deepinfer.workers.loader import DTYPES, load_model
from deepinfer.workers.sample.sampler import Sampler, SamplingState
from deepinfer.workers.spec_decode.base import (
    Draft,
    DraftRequest,
    Proposer,
    StepInput,
    extend_drafts,
    finish_drafts,
)


def check_vocabulary(draft_dir: str, target_dir: str) -> None:
    """The draft must tokenize like the target: same tokenizer vocabulary when both ship a
    tokenizer.json, else the same vocabulary size."""
    files = [Path(d) / "tokenizer.json" for d in (draft_dir, target_dir)]
    if all(f.exists() for f in files):
        vocabs = [json.loads(f.read_text())["model"].get("vocab") for f in files]
        if vocabs[0] != vocabs[1]:
            raise ModelConfigError(f"the draft model {draft_dir} does not share the target's "
                                   "tokenizer vocabulary")
    elif ModelConfig.from_dir(draft_dir).vocab_size != ModelConfig.from_dir(target_dir).vocab_size:
        raise ModelConfigError("the draft model's vocabulary size differs from the target's")


class DraftModelProposer(Proposer):
    def __init__(self, draft_dir: str, target_dir: str, dtype: str, num_blocks: int,
                 block_size: int, weight_copies: str, sampler: Sampler,
                 kv_dtype: str | None = None) -> None:
        """`kv_dtype`: what the draft's KV cache stores (the target's --kv-cache-dtype; default
        `dtype`): it has as many blocks as the target's, sized by the target's type."""
        target = ModelConfig.from_dir(target_dir)
        cfg = ModelConfig.from_dir(draft_dir)
        if not target.kv_cache_layout().layers_of(FULL):
            raise ModelConfigError("a draft model needs a target with full-attention layers")
        if set(cfg.layer_kinds) != {FULL}:
            raise ModelConfigError("the draft model must use full attention in every layer")
        check_vocabulary(draft_dir, target_dir)
        torch_dtype = DTYPES[dtype]
        self.model = load_model(draft_dir, dtype, weight_copies,
                                select_backend("cpu", torch_dtype))
        self.attention = self.model.model.layers[0].self_attn.backend
        self.block_size = block_size
        self.vocab_size = target.vocab_size
        self.sampler = sampler
        self.kv = KVCache(cfg.kv_cache_layout(block_size).layers, num_blocks, block_size,
                          DTYPES[kv_dtype or dtype])
        self.frontier: dict[str, int] = {}  # positions [0, frontier) hold the draft's K/V
        self.tables: dict[str, np.ndarray] = {}
        # The requests it has drafted for: their tokens fill a gap (the last draft of a fully
        # accepted run, never read) also in a step where they do not speculate.
        self.states: dict[str, SamplingState] = {}

    # ------------------------------------------------------------------ the proposer seam

    def propose(self, step: list[StepInput], requests: list[DraftRequest]) -> list[Draft]:
        self.states.update((r.request_id, r.state) for r in requests)
        last_rows = self._catch_up(step)
        if not requests:
            return []
        logits = self._logits(last_rows, [r.request_id for r in requests])
        drafts = [Draft([], None if r.state.params.is_greedy() else []) for r in requests]
        extend_drafts(self.sampler, requests, drafts, logits)
        for i in range(1, max(r.max_drafts for r in requests)):
            live = [(r, d) for r, d in zip(requests, drafts) if len(d.tokens) < r.max_drafts]
            hidden = self._forward([(r.request_id, r.start + i, np.asarray([d.tokens[-1]]))
                                    for r, d in live])
            extend_drafts(self.sampler, [r for r, _ in live], [d for _, d in live],
                          self.model.compute_logits(hidden)[:, : self.vocab_size])
        return finish_drafts(drafts)

    def verified(self, request: DraftRequest, proposed: int, accepted: int) -> None:
        # It read its input token and drafts 1..proposed-1: valid as far as they were kept.
        self.frontier[request.request_id] = (request.start + 1
                                             + min(accepted, max(proposed - 1, 0)))

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.frontier.pop(rid, None)
            self.tables.pop(rid, None)
            self.states.pop(rid, None)

    # ------------------------------------------------------------------ internals

    def _catch_up(self, step: list[StepInput]) -> dict[str, int]:
        """K/V for every position the target computes this step and the draft has not seen;
        returns the row of each speculating request's input token in the logits computed."""
        rows: list[tuple[str, int, np.ndarray]] = []
        for s in step:
            if s.full_table is None:
                continue
            self.tables[s.request_id] = s.full_table
            end = s.start + len(s.tokens)
            first = max(s.start, s.full_kv_from)  # below: cached, the draft's K/V included
            lo = min(self.frontier.get(s.request_id, first), first)
            tokens = s.tokens[first - s.start:]
            if lo < first:  # a kept draft it never read: from the request's own tokens
                state = self.states.get(s.request_id)
                if state is None:
                    lo = first
                else:
                    known = np.concatenate([state.prompt_ids.numpy(),
                                            np.asarray(state.output_ids, dtype=np.int32)])
                    tokens = np.concatenate([known[lo:first], tokens])
            if len(tokens):
                rows.append((s.request_id, lo, tokens.astype(np.int32)))
            self.frontier[s.request_id] = end
        self._hidden = self._forward(rows) if rows else None
        last, row = {}, 0
        for rid, _, tokens in rows:
            row += len(tokens)
            last[rid] = row - 1
        return last

    def _logits(self, last_rows: dict[str, int], rids: list[str]) -> torch.Tensor:
        index = torch.tensor([last_rows[rid] for rid in rids])
        return self.model.compute_logits(self._hidden[index])[:, : self.vocab_size]

    def _forward(self, rows: list[tuple[str, int, np.ndarray]]) -> torch.Tensor:
        slices = [SeqSlice(self.tables[rid], start, len(tokens), write_from=start)
                  for rid, start, tokens in rows]
        meta = self.attention.build_metadata(slices, self.block_size, None)
        ids = torch.from_numpy(np.concatenate([t for _, _, t in rows]).astype(np.int64))
        pos = torch.from_numpy(np.concatenate(
            [np.arange(start, start + len(t)) for _, start, t in rows]).astype(np.int64))
        return self.model(ids, pos, self.kv, [meta])
