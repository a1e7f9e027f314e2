"""Verification of drafted tokens: greedy matching, coupled sampling or exact rejection sampling.

A speculating request's step computes the target's logits at its input token and at each of its
d drafts x_0..x_{d-1} (rows 0..d). Row j gives the target's distribution p_j for the request's
output token k + j (k: the output tokens it had before the step), the token x_j proposes.

- Greedy: x_j is accepted while it equals argmax p_j; the first mismatch (or row d, when every
  draft was accepted) contributes the target's own argmax. The text is exactly what plain
  greedy decoding gives.
- Seeded sampling (coupled): the target's token at row j is y_j, drawn from p_j with the
  uniform u(seed, k + j) exactly as plain sampling draws output token k + j
  (workers/sample/sampler.py); x_j is accepted while it equals y_j, the first y_j that differs
  (or y_d) follows. The text is exactly that of plain sampling with the same seed, whatever
  the drafts and however many there were (the batch decides that): each token is distributed
  as p. A deterministic draft x_j (n-gram) is accepted with probability p_j(x_j), as in
  rejection sampling; a draft model draws x_j with the same u(seed, k + j) from its q_j
  (common random numbers, workers/spec_decode/base.py), so a draft model that agrees with the
  target is always accepted (the acceptance is the overlap of the two inverse CDFs'
  intervals, at most rejection sampling's sum of min(p_j, q_j)).
- Unseeded sampling (Leviathan et al., Chen et al.): draft x_j, proposed with probability
  q_j(x_j), is accepted with probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection
  the token is drawn from the residual max(p_j - q_j, 0), renormalized; if all are accepted one
  more token is drawn from p_d. Every emitted token is then distributed exactly as the
  target's, with the best acceptance any verification of these drafts can have. A proposer
  without a distribution (n-gram lookup) proposes deterministically: q_j is one-hot, the
  acceptance probability is p_j(x_j) and the residual is p_j without x_j. The uniform numbers
  come from the engine's generator.

p_j is the same processed distribution plain sampling uses (penalties counting the drafts
before j as output, temperature, top-k, top-p, min-p), and q_j was made by the proposer with the
same processing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer.engine.protocol import SampledLogprobs
from deepinfer.workers.sample.sampler import (
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
            best = argmax_rows(scores[start: start + n]).tolist()
            tokens = _matching(v.drafts, best.__getitem__)
        elif v.state.params.seed is not None:
            tokens = _coupled(sampler, probs[start: start + n], v)
        else:
            tokens = _rejection(sampler, probs[start: start + n], v)
        emitted = torch.tensor(tokens)
        out.append((tokens, logprob_entries(raw[start: start + len(tokens)], emitted,
                                            [v.state] * len(tokens))))
        start += n
    return out


def _matching(drafts: list[int], target: Callable[[int], int]) -> list[int]:
    """The drafts while each equals the target's token at its row (`target(j)`), then the
    target's token at the first row that differs, or at the row after the last draft."""
    tokens = []
    for j, draft in enumerate(drafts):
        y = target(j)
        if draft != y:
            return tokens + [y]
        tokens.append(draft)
    return tokens + [target(len(drafts))]


def _coupled(sampler: Sampler, probs: torch.Tensor, v: Verification) -> list[int]:
    """A seeded request: the target's token at row j is what plain sampling draws for output
    k + j, with u(seed, k + j)."""
    k = len(v.state.output_ids)
    return _matching(v.drafts, lambda j: sampler.draw(v.state, probs[j], k + j))


def _rejection(sampler: Sampler, probs: torch.Tensor, v: Verification) -> list[int]:
    k = len(v.state.output_ids)
    tokens = []
    for j, draft in enumerate(v.drafts):
        p = probs[j]
        q_x = 1.0 if v.draft_probs is None else float(v.draft_probs[j, draft])
        if sampler.uniform(v.state, k + j) * q_x < float(p[draft]):
            tokens.append(draft)
            continue
        if v.draft_probs is None:
            residual = p.clone()
            residual[draft] = 0.0
        else:
            residual = (p - v.draft_probs[j]).clamp_(min=0.0)
        tokens.append(sampler.draw(v.state, residual if residual.sum() > 0 else p, k + j))
        return tokens
    tokens.append(sampler.draw(v.state, probs[len(v.drafts)], k + len(v.drafts)))
    return tokens
