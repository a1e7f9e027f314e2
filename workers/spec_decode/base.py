"""The proposer seam: what a drafting method sees each step and what it returns.

Every method (n-gram lookup, a draft model, the target's own MTP / EAGLE-style heads) proposes
up to `max_drafts` tokens per speculating request at the start of a step; the target verifies
them in the same forward (workers/sample/rejection.py). A proposer sees:
- `StepInput`s: every seq of the step with its real input tokens and full-attention block table,
  so a draft model can keep its own KV cache (same block ids, its own tensors) in step with the
  target's;
- `DraftRequest`s: the speculating requests, with their sampling state (params, seed, the
  tokens so far) and, for proposers that ask (`needs_hidden_states`), the target's last hidden
  state: the one that produced the request's newest token.
After verification it is told how many drafts each request kept (`verified`); proposers that
follow the target's hidden states at every position (`observes`: MTP) then see what the target
computed for each seq (`observe`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.workers.kv_cache import KVCache
from deepinfer.workers.sample.sampler import (
    Sampler,
    SamplingState,
    argmax_rows,
    penalized,
    processed_probs,
)


@dataclass
class StepInput:
    """One seq of the step: its real input tokens (no drafts) at positions start.."""

    request_id: str
    tokens: np.ndarray
    start: int
    full_table: np.ndarray | None  # block table of the full-attention group (None: none)
    full_kv_from: int = 0  # full layers already hold K/V below this (prefix hit replay)


@dataclass
class DraftRequest:
    request_id: str
    state: SamplingState
    start: int  # position of its input token, the newest known token
    max_drafts: int
    hidden: torch.Tensor | None = None  # the target's hidden state that produced that token

    def known_tokens(self) -> np.ndarray:
        """Prompt, then every output token so far (int32)."""
        out = np.asarray(self.state.output_ids, dtype=np.int32)
        return np.concatenate([self.state.prompt_ids.numpy().astype(np.int32), out])


@dataclass
class ObservedSeq:
    """What the target computed for one seq in a step: its valid rows (inputs, then the drafts
    it kept) with their final hidden states."""

    request_id: str
    start: int  # position of the first row
    tokens: np.ndarray
    next_token: int | None  # the token after the last row (sampled, or the prompt's next)
    hidden: torch.Tensor  # [len(tokens), hidden]
    full_table: np.ndarray | None
    full_kv_from: int  # rows below this position only replayed cached K/V


@dataclass
class Draft:
    tokens: list[int]
    # [len(tokens), vocab]: the distribution each draft was sampled from, processed like the
    # target's (rejection sampling needs it); None: proposed deterministically.
    probs: torch.Tensor | None = None


class Proposer:
    needs_hidden_states = False
    observes = False  # wants `observe` after every step
    # Its own KV cache in the target's full-attention blocks, if it keeps one: the host tier
    # moves its blocks with the target's.
    kv: KVCache | None = None

    def propose(self, step: list[StepInput], requests: list[DraftRequest]) -> list[Draft]:
        raise NotImplementedError

    def target_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """What this proposer reads of the target per batch row (`observe`'s and `record`'s
        hidden): by default the model's final hidden state, `hidden`; a proposer may read
        something else the step's forward computed (DeepSeek-V4's residual streams, chosen
        layers' outputs), row for row."""
        return hidden

    def verified(self, request: DraftRequest, proposed: int, accepted: int) -> None:
        """The target kept the first `accepted` of the `proposed` drafts."""

    def observe(self, seqs: list[ObservedSeq]) -> None:
        """The step's seqs, after sampling (only when `observes`)."""

    def forget(self, request_ids: list[str]) -> None:
        """These requests are finished."""


def extend_drafts(sampler: Sampler, requests: list[DraftRequest], drafts: list[Draft],
                  logits: torch.Tensor) -> None:
    """One more draft token per request from a proposer's logits, processed like the target's
    distribution (penalties count the drafts so far as output); sampled drafts keep the
    distribution they were drawn from (`Draft.probs`, a list until `finish_drafts`). A seeded
    request's draft for its output token k is drawn with u(seed, k), the uniform its
    verification draws the target's token k with (workers/sample/rejection.py): a draft model
    that agrees with the target proposes exactly the target's token."""
    states = [r.state for r in requests]
    scores = penalized(logits.float(), states, [d.tokens for d in drafts])
    greedy = [s.params.is_greedy() for s in states]
    probs = None if all(greedy) else processed_probs(scores, states, greedy)
    for i, (state, draft) in enumerate(zip(states, drafts)):
        if greedy[i]:
            draft.tokens.append(int(argmax_rows(scores[i: i + 1])[0]))
            continue
        index = len(state.output_ids) + len(draft.tokens)  # the output token it drafts
        draft.tokens.append(sampler.draw(state, probs[i], index))
        draft.probs.append(probs[i])


def finish_drafts(drafts: list[Draft]) -> list[Draft]:
    for d in drafts:
        if d.probs is not None:
            d.probs = torch.stack(d.probs) if d.probs else None
    return drafts
