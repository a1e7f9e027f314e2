"""Prompt logprobs: per prompt position, the log-softmax of the logits before it, at the prompt's
own token there, with that token's rank and the top-k alternatives (vLLM's prompt_logprobs).

A prefill chunk computes positions [start, start + n); the logits at position p predict prompt
token p + 1, so the chunk reports tokens start + 1 .. min(start + n, P - 1) (the last prompt
position's logits predict the first generated token: sampling's business). Logits are computed
ROWS_PER_SLICE rows at a time: a long chunk never holds its whole [rows, vocab] logits (nor
their log-softmax) at once. Under tensor parallelism every rank computes the logits (the LM head
gathers the vocabulary over the ranks), and only the rank that answers reduces them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.engine.protocol import PromptChunkLogprobs

# [128, vocab] float32 logits plus their log-softmax: ~50 MB for a 49k vocabulary.
ROWS_PER_SLICE = 128


@dataclass(frozen=True)
class PromptTargets:
    """One chunk's part: hidden rows first_row.. predict the prompt tokens `tokens`, the
    first at prompt position `start`."""

    first_row: int
    start: int
    tokens: torch.Tensor  # int64; may be empty (the chunk predicts only the first sample)
    k: int  # top alternatives per position


def chunk_targets(prompt: torch.Tensor, start_pos: int, num_tokens: int, first_row: int,
                  k: int) -> PromptTargets:
    """A prefill chunk of `num_tokens` prompt tokens from `start_pos`, at `first_row`."""
    end = min(start_pos + num_tokens, len(prompt) - 1)
    return PromptTargets(first_row, start_pos + 1, prompt[start_pos + 1: end + 1].long(), k)


def prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                    hidden: torch.Tensor, chunks: list[PromptTargets], reduce: bool
                    ) -> list[PromptChunkLogprobs]:
    """One entry per chunk, in order (empty where it predicts no prompt token). `reduce`:
    this rank answers (the others only take part in the LM head's collective: [])."""
    out = []
    for c in chunks:
        targets = c.tokens.to(hidden.device)
        parts = []
        for a in range(0, len(targets), ROWS_PER_SLICE):
            b = min(len(targets), a + ROWS_PER_SLICE)
            logits = compute_logits(hidden.narrow(0, c.first_row + a, b - a))
            if reduce:
                parts.append(_reduce(logits, targets[a:b], c.k))
        if reduce:
            out.append(_pack(c.start, parts))
    return out


def _reduce(logits: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """(logprob, rank, top ids, top logprobs) of each row's target, on the host."""
    logp = logits.float().log_softmax(dim=-1)
    chosen = logp.gather(1, targets.unsqueeze(1))
    # Rank as vLLM counts it: tokens at least as likely, the target itself included.
    ranks = (logp >= chosen).sum(dim=-1)
    k = min(k, logp.shape[1])
    top_vals, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], ranks[:, None][:, :0])
    return (chosen.squeeze(1).cpu(), ranks.cpu(), top_ids.cpu(), top_vals.cpu())


def _pack(start: int, parts: list[tuple[torch.Tensor, ...]]) -> PromptChunkLogprobs:
    if not parts:
        return PromptChunkLogprobs(start, b"", b"")
    chosen, ranks, top_ids, top_vals = (torch.cat(col) for col in zip(*parts))
    return PromptChunkLogprobs(
        start,
        chosen.numpy().astype(np.float32).tobytes(),
        ranks.numpy().astype(np.int32).tobytes(),
        top_ids.numpy().astype(np.int32).tobytes(),
        top_vals.numpy().astype(np.float32).tobytes(),
    )
