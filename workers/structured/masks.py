"""Grammar masks for one step: which tokens each constrained logits row may take.

A speculating request's rows are its input token's and its drafts': row j is masked with the
matcher advanced over drafts[:j], so the rejection sampler checks every draft against the
grammar. Drafts the grammar refuses are cut before the forward (`allowed_drafts`), and the
matcher is always rolled back to the request's accepted tokens afterwards: it only ever moves
forward with the tokens the step finally emits (`accept`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("deepinfer.worker")


@dataclass
class MaskedRows:
    matcher: object  # an xgrammar GrammarMatcher
    drafts: list[int]
    first_row: int  # logits row of the input token; the drafts' rows follow


class AfterMarker:
    """A matcher that starts once the output has written `marker` (token ids): the reasoning
    before it is free, the answer after it follows the grammar. It moves (and rolls back) over
    tokens like the matcher it wraps, so masks, drafts and acceptance need not know.

    With `opener` (a token), the reasoning is optional: the first token is the grammar's or the
    opener, and an output that does not start with the opener follows the grammar at once."""

    def __init__(self, inner, marker: list[int], opener: int | None = None) -> None:
        self.inner, self.marker, self.opener = inner, marker, opener
        self.free: list[int] = []  # tokens before the grammar started, the marker's included
        self.started = not marker
        self.constrained = 0  # tokens the inner matcher accepted (what a rollback may undo)

    def _first(self) -> bool:
        """No token yet, and the reasoning is optional: the first decides."""
        return self.opener is not None and not self.started and not self.free

    def is_terminated(self) -> bool:
        return self.started and self.inner.is_terminated()

    def accept_token(self, token: int) -> bool:
        if self.started or (self._first() and token != self.opener):
            ok = self.inner.accept_token(token)
            self.constrained += ok
            self.started = self.started or ok  # (a refused first draft decides nothing)
            return ok
        self.free.append(token)
        self.started = self.free[-len(self.marker):] == self.marker
        return True

    def rollback(self, n: int) -> None:
        inner = min(n, self.constrained)
        if inner:
            self.inner.rollback(inner)
            self.constrained -= inner
        if n > inner:  # back into the free part: before the marker's end again
            del self.free[len(self.free) - (n - inner):]
            self.started = False
        if self.opener is not None and not self.free and not self.constrained:
            self.started = False  # back to the first token: undecided again

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.started or self._first():  # else the row stays as allocated: all allowed
            self.inner.fill_next_token_bitmask(bitmask, row)
        if self._first():  # ...or the opener
            word, bit = divmod(self.opener, 32)
            value = int(bitmask[row, word]) | (1 << bit)  # an int32 word
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


def allowed_drafts(matcher, drafts: list[int], keep_refused: bool) -> list[int]:
    """The drafts up to the first the grammar refuses. With `keep_refused` that one stays: a
    draft sampled from a distribution must still meet rejection sampling (which then rejects it
    for sure and draws from the residual), or the output distribution would not be exact."""
    n = 0
    for token in drafts:
        if matcher.is_terminated() or not matcher.accept_token(token):
            break
        n += 1
    if n:
        matcher.rollback(n)
    return drafts[: n + 1] if keep_refused and n < len(drafts) else drafts[:n]


def fill_bitmask(backend, rows: list[MaskedRows], num_rows: int) -> tuple[torch.Tensor, list[int]]:
    """The step's bitmask over `num_rows` logits rows and the rows it constrains."""
    bitmask = backend.allocate(num_rows)
    masked: list[int] = []
    for r in rows:
        m, advanced = r.matcher, 0
        for j in range(len(r.drafts) + 1):
            if m.is_terminated():  # its stop token is in: an overlap step past the end
                break
            m.fill_next_token_bitmask(bitmask, r.first_row + j)
            masked.append(r.first_row + j)
            if j == len(r.drafts) or not m.accept_token(r.drafts[j]):
                break
            advanced += 1
        if advanced:
            m.rollback(advanced)
    return bitmask, masked


def constrain(backend, logits: torch.Tensor, rows: list[MaskedRows]) -> None:
    """Tokens the grammar forbids get -inf in `logits`, on constrained requests' rows only
    (their logprobs are then the constrained distribution's)."""
    if not rows:
        return
    bitmask, masked = fill_bitmask(backend, rows, logits.shape[0])
    if masked:
        backend.apply(logits, bitmask, masked)


def accept(matcher, tokens: list[int]) -> None:
    """Advance the matcher over the tokens the step emitted (all allowed by its masks)."""
    for token in tokens:
        if matcher.is_terminated():
            return
        if not matcher.accept_token(token):
            log.warning("grammar refused sampled token %d; the output may not match", token)
            return
