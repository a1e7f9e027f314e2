"""When a request speculates, how many draft slots it gets, and what verification told us.

The scheduler reserves KV slots for up to k draft tokens after a decode's input token; the
worker proposes drafts into them (n-gram, draft model, MTP) and verifies them in the same step,
returning 1..k+1 new tokens. This module holds the decisions and the counters:

- Only a request whose last token is known (nothing in flight) can speculate: its new tokens,
  and so its next position, are unknown until the result arrives. The scheduler process
  therefore waits for the previous step before planning one that speculates (no overlap then).
- Backoff: a proposer that finds nothing (an n-gram lookup with no match) costs a step without
  overlap for nothing, so after a miss the request decodes plainly (overlapped) for 1, 2, 4, 8,
  then 16 steps before it tries again; a proposal resets the backoff. On a workload with nothing
  to copy, speculation then costs almost nothing.
- No speculation in a step with more running requests than `disable_by_batch_size`: big
  batches are compute bound, where verifying drafts only adds work.
"""

from __future__ import annotations

from deepinfer.engine.request import Request

MAX_BACKOFF = 16


class SpecPolicy:
    def __init__(self, num_tokens: int, disable_by_batch_size: int | None = None) -> None:
        self.num_tokens = num_tokens  # K: most drafts per step (0: speculation off)
        self.disable_by_batch_size = disable_by_batch_size
        self.verify_steps = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.drafts_by_position = [0] * num_tokens
        self.accepted_by_position = [0] * num_tokens

    def _allowed(self, req: Request, num_running: int) -> bool:
        """Speculation is on for this request now, whatever its in-flight state."""
        return (self.num_tokens > 0 and req.params.speculative
                and (self.disable_by_batch_size is None
                     or num_running <= self.disable_by_batch_size)
                and req.num_computed >= req.num_prompt  # decoding, not prefilling
                and req.params.max_tokens - len(req.output_ids) - req.num_pending >= 2)

    def wants(self, running: list[Request]) -> bool:
        """Would a running request speculate in the next step if its last token were known?"""
        if not self.num_tokens:
            return False
        return any(self._allowed(r, len(running)) and not r.spec_backoff for r in running)

    def draft_slots(self, req: Request, num_running: int, budget: int, max_len: int) -> int:
        """Draft slots for a decode of `req` this step (0: a plain decode)."""
        if not self._allowed(req, num_running):
            return 0
        if req.spec_backoff:  # counted down by plain decodes, overlapped ones included
            req.spec_backoff -= 1
            return 0
        if req.num_pending:
            return 0
        left = req.params.max_tokens - len(req.output_ids)
        # k drafts + 1 target token must fit the output budget and the sequence limit.
        return max(0, min(self.num_tokens, left - 1, max_len - req.num_tokens - 1, budget))

    def record(self, req: Request, proposed: int, accepted: int) -> None:
        """A verified step: `proposed` drafts, of which the first `accepted` were kept."""
        if proposed == 0:
            req.spec_misses += 1
            req.spec_backoff = min(MAX_BACKOFF, 1 << (req.spec_misses - 1))
            return
        req.spec_misses = 0
        self.verify_steps += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        for i in range(proposed):
            self.drafts_by_position[i] += 1
        for i in range(accepted):
            self.accepted_by_position[i] += 1
