"""Speculative decoding as the runner sees it: one object between a step and the proposer.

Each step `propose` asks the proposer for drafts for the seqs the scheduler gave draft slots
(cut where a request's grammar refuses them); after sampling `record` tells it how many each
request kept and keeps the target's hidden state that produced each newest token (for proposers
that read it), and `observe` shows proposers that follow the target's hidden states what it
computed. Without a proposer (no --speculative-method), seqs given draft slots verify no draft.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
import torch

from deepinfer.engine.protocol import ScheduledSeq
from deepinfer.workers.kv_cache import KVCache
from deepinfer.workers.sample.sampler import SamplingState
from deepinfer.workers.sample.step import NewTokens
from deepinfer.workers.spec_decode.base import (
    Draft,
    DraftRequest,
    ObservedSeq,
    Proposer,
    StepInput,
)
from deepinfer.workers.structured.masks import allowed_drafts


class BatchSeq(Protocol):
    """What this reads of a seq's rows in the step's batch (workers/step_batch.py SeqRows,
    which builds on this folder, so the fields are named here)."""

    seq: ScheduledSeq
    state: SamplingState
    tokens: np.ndarray  # its real input tokens
    first_row: int  # of its input tokens in the batch
    draft: Draft | None
    logit_row: int  # of its first verified (or only) row in the step's logits


class Speculation:
    def __init__(self, proposer: Proposer | None) -> None:
        self.proposer = proposer
        self.last_hidden: dict[str, torch.Tensor] = {}  # for proposers that read it
        self.requests: dict[str, DraftRequest] = {}  # this step's, by request id

    def caches(self) -> list[KVCache]:
        """The proposer's own KV cache, if it keeps one (the host tier copies it too)."""
        kv = self.proposer.kv if self.proposer is not None else None
        return [kv] if kv is not None else []

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.last_hidden.pop(rid, None)
        if self.proposer is not None and request_ids:
            self.proposer.forget(request_ids)

    def propose(self, seqs: Sequence[ScheduledSeq], inputs: list[StepInput],
                states: Mapping[str, SamplingState]) -> dict[int, Draft]:
        """Drafts by seq index, for the seqs given draft slots (possibly none found)."""
        requests = {i: DraftRequest(seq.request_id, states[seq.request_id], seq.start_pos,
                                    seq.draft_slots, self.last_hidden.get(seq.request_id))
                    for i, seq in enumerate(seqs) if seq.draft_slots and seq.sample}
        self.requests = {req.request_id: req for req in requests.values()}
        if self.proposer is None:
            return {i: Draft([]) for i in requests}
        drafts = self.proposer.propose(inputs, list(requests.values()))
        out = {}
        for (i, req), draft in zip(requests.items(), drafts):
            keep = draft.tokens[: req.max_drafts]
            if req.state.grammar is not None:
                keep = allowed_drafts(req.state.grammar, keep, draft.probs is not None)
            probs = draft.probs[: len(keep)] if draft.probs is not None else None
            out[i] = Draft(keep, probs)
        return out

    def record(self, sampled: Sequence[BatchSeq], new: Sequence[NewTokens],
               hidden: torch.Tensor, index: list[int]) -> None:
        """After sampling: how many drafts each speculating request kept, and the hidden state
        whose logits (batch row `index[logit row]`) produced its newest token."""
        if self.proposer is None:
            return
        keep_hidden = self.proposer.needs_hidden_states
        if keep_hidden:
            hidden = self.proposer.target_hidden(hidden)
        for r, (tokens, _) in zip(sampled, new):
            req = self.requests.get(r.seq.request_id)
            if req is not None:
                self.proposer.verified(req, len(r.draft.tokens), len(tokens) - 1)
            if keep_hidden:
                self.last_hidden[r.seq.request_id] = hidden[index[r.logit_row + len(tokens) - 1]]

    def observe(self, rows: Sequence[BatchSeq], inputs: list[StepInput],
                hidden: torch.Tensor) -> None:
        """Tell a proposer that follows the target's hidden states what each seq computed: its
        input rows and the drafts it kept (after the states took the step's tokens)."""
        if self.proposer is None or not self.proposer.observes:
            return
        hidden = self.proposer.target_hidden(hidden)
        seqs = []
        for r, inp in zip(rows, inputs):
            state, start = r.state, r.seq.start_pos
            known = len(state.prompt_ids) + len(state.output_ids)
            kept = 0
            if r.draft:  # the verified tokens after the input: kept drafts, then one more
                kept = known - (start + len(r.tokens)) - 1
            tokens = np.concatenate([r.tokens, np.asarray(r.draft.tokens[:kept], np.int32)]
                                    ) if kept else r.tokens
            end = start + len(tokens)
            nxt = None
            if end < known:
                nxt = int(state.prompt_ids[end]) if end < len(state.prompt_ids) else int(
                    state.output_ids[end - len(state.prompt_ids)])
            seqs.append(ObservedSeq(r.seq.request_id, start, tokens, nxt,
                                    hidden[r.first_row: r.first_row + len(tokens)],
                                    inp.full_table, inp.full_kv_from))
        self.proposer.observe(seqs)
