"""Verification of drafted tokens: greedy matching or exact rejection sampling.

A speculating request's step computes the target's logits at its input token and at each of its
d drafts (rows 0..d). Row j gives the target's distribution p_j for the token after draft j.

- Greedy: draft j+1 is accepted while it equals argmax p_j; the first mismatch (or row d, when
  every draft was accepted) contributes the target's own argmax. The text is exactly what plain
  greedy decoding gives.
- Sampling (Leviathan et al., Chen et al.): draft x_j, proposed with probability q_j(x_j), is
  accepted with probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection the token is
  drawn from the residual max(p_j - q_j, 0), renormalized; if all are accepted one more token
  is drawn from p_d. Every emitted token is then distributed exactly as the target's. A proposer
  without a distribution (n-gram lookup) proposes deterministically: q_j is one-hot, the
  acceptance probability is p_j(x_j) and the residual is p_j without x_j.

p_j is the same processed distribution plain sampling uses (penalties counting the drafts
before j as output, temperature, top-k, top-p, min-p), and q_j was made by the proposer with the
same processing. Uniform draws come from the request's own generator when it is seeded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.protocol import SampledLogprobs
from workers.sample.sampler import (
    Sampler,
    SamplingState,
    argmax_rows,
    logprob_entries,
    penalized,
    processed_probs,
)


@dataclass
class Verification:
    """One speculating request's rows of the step's logits."""

    state: SamplingState
    drafts: list[int]
    draft_probs: torch.Tensor | None  # [d, V] q_j, or None: deterministic proposals
    first_row: int  # row of its input token in the logits; drafts follow


def verify(sampler: Sampler, logits: torch.Tensor, seqs: list[Verification]
           ) -> list[tuple[list[int], list[SampledLogprobs | None]]]:
    """The new tokens (accepted drafts, then one of the target's) and their logprobs, per seq."""
    rows = torch.tensor([v.first_row + j for v in seqs for j in range(len(v.drafts) + 1)])
    raw = logits.index_select(0, rows)
    states = [v.state for v in seqs for _ in range(len(v.drafts) + 1)]
    extra = [v.drafts[:j] for v in seqs for j in range(len(v.drafts) + 1)]
    scores = penalized(raw, states, extra)
    probs = None
    if not all(s.params.is_greedy() for s in states):
        probs = processed_probs(scores, states)
    out = []
    start = 0
    for v in seqs:
        n = len(v.drafts) + 1
        if v.state.params.is_greedy():
            tokens = _greedy(scores[start: start + n], v.drafts)
        else:
            tokens = _rejection(sampler, probs[start: start + n], v)
        emitted = torch.tensor(tokens)
        out.append((tokens, logprob_entries(raw[start: start + len(tokens)], emitted,
                                            [v.state] * len(tokens))))
        start += n
    return out


def _greedy(scores: torch.Tensor, drafts: list[int]) -> list[int]:
    best = argmax_rows(scores).tolist()
    tokens = []
    for j, draft in enumerate(drafts):
        if draft != best[j]:
            break
        tokens.append(draft)
    tokens.append(best[len(tokens)])
    return tokens


def _rejection(sampler: Sampler, probs: torch.Tensor, v: Verification) -> list[int]:
    tokens = []
    for j, draft in enumerate(v.drafts):
        p = probs[j]
        q_x = 1.0 if v.draft_probs is None else float(v.draft_probs[j, draft])
        if sampler.uniform(v.state) * q_x < float(p[draft]):
            tokens.append(draft)
            continue
        if v.draft_probs is None:
            residual = p.clone()
            residual[draft] = 0.0
        else:
            residual = (p - v.draft_probs[j]).clamp_(min=0.0)
        tokens.append(sampler.draw(v.state, residual if residual.sum() > 0 else p))
        return tokens
    tokens.append(sampler.draw(v.state, probs[len(v.drafts)]))
    return tokens
