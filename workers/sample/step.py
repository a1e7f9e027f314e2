"""A step's draws: every sampled seq's new tokens from the step's logits.

Seqs without drafts take one token each, in one batched draw (sampler.py); seqs that verify
drafts (even none) go through the rejection sampler (rejection.py), which keeps a prefix of the
drafts and adds one token of the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.engine.protocol import SampledLogprobs
from deepinfer.workers.sample.rejection import Verification, verify
from deepinfer.workers.sample.sampler import Sampler, SamplingState

# A seq's new tokens and their logprobs (None where its request did not ask).
NewTokens = tuple[list[int], list[SampledLogprobs | None]]


@dataclass
class SeqToSample:
    state: SamplingState
    logit_row: int  # its row in the step's logits (verifying: its input token's; drafts follow)
    drafts: list[int] | None = None  # None: a plain draw; a list (maybe empty): verification
    draft_probs: torch.Tensor | None = None  # as Verification.draft_probs


def rows_of(t: torch.Tensor, index: list[int]) -> torch.Tensor:
    """t's rows at `index`: a view when they are consecutive (a batch's logit rows usually
    are), else one index_select (advanced indexing costs ~3x more on CPU: ~45 us a step)."""
    if index and index == list(range(index[0], index[0] + len(index))):
        return t.narrow(0, index[0], len(index))
    return t.index_select(0, torch.tensor(index, dtype=torch.int64, device=t.device))


def sample_step(sampler: Sampler, logits: torch.Tensor, seqs: list[SeqToSample]
                ) -> list[NewTokens]:
    """New tokens and their logprobs per seq, in `seqs`' order."""
    out: list = [None] * len(seqs)
    plain = [i for i, s in enumerate(seqs) if s.drafts is None]
    if plain:
        rows = rows_of(logits, [seqs[i].logit_row for i in plain])
        tokens, logprobs = sampler(rows, [seqs[i].state for i in plain])
        for j, (i, token) in enumerate(zip(plain, tokens.tolist())):
            out[i] = ([token], [logprobs[j]] if logprobs else [None])
    checks = [i for i, s in enumerate(seqs) if s.drafts is not None]
    if checks:
        verified = verify(sampler, logits, [
            Verification(seqs[i].state, seqs[i].drafts, seqs[i].draft_probs, seqs[i].logit_row)
            for i in checks])
        for i, (tokens, logprobs) in zip(checks, verified):
            out[i] = (tokens, logprobs or [None] * len(tokens))
    return out
