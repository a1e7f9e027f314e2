"""N-gram (prompt lookup) proposer: drafts copied from the request's own earlier tokens.

When an answer copies its prompt (rewrite this code, repeat this list), the tokens that followed
an earlier occurrence of the latest few tokens are a good guess for what comes next, and finding
them needs no extra weights. It runs for every speculating request on every decode step, so the
search is a handful of vectorised numpy passes: one comparison of the last token against the
whole history, then each longer n only re-checks the positions that still match.
"""

from __future__ import annotations

import numpy as np

from deepinfer.workers.spec_decode.base import Draft, DraftRequest, Proposer, StepInput


class NgramProposer(Proposer):
    """Prompt lookup: no weights, deterministic drafts from each request's own tokens, by suffix
    lookup; n from `max_n` down to `min_n`, longest match first."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if min_n < 1 or max_n < min_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, step: list[StepInput], requests: list[DraftRequest]) -> list[Draft]:
        return [Draft(self.lookup(r.known_tokens(), r.max_drafts)) for r in requests]

    def lookup(self, tokens: np.ndarray, k: int) -> list[int]:
        """Up to k draft tokens for a request whose known tokens (prompt, then outputs; int32) are
        `tokens`: find the longest suffix of length n (max_n down to min_n) that also occurs
        earlier in `tokens`, take its most recent earlier occurrence, and propose the tokens that
        followed it (at most k, fewer when the history ends). [] when nothing matches."""
        tokens = np.asarray(tokens)
        length = tokens.shape[0]
        if k <= 0 or length <= self.min_n:  # an earlier occurrence needs n + 1 tokens at least
            return []
        # `ends` are the last positions of earlier windows that match the suffix so far. Windows
        # end at length - 2 at the latest: the one ending at length - 1 is the suffix itself.
        ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
        best = ends if self.min_n == 1 else None
        for n in range(2, min(self.max_n, length - 1) + 1):
            ends = ends[ends >= n - 1]  # the window must start at position 0 or later
            ends = ends[tokens[ends - (n - 1)] == tokens[length - n]]
            if ends.size == 0:
                break  # no window matches n tokens, so none matches more
            if n >= self.min_n:
                best = ends
        if best is None or best.size == 0:
            return []
        start = int(best[-1]) + 1  # most recent earlier occurrence: `ends` stays ascending
        return tokens[start : start + k].tolist()
