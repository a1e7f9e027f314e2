"""A request as the scheduler tracks it: tokens, progress, KV blocks."""

from __future__ import annotations

import enum

import numpy as np

from deepinfer.engine.protocol import FinishReason, PromptChunkLogprobs, SamplingParams


class Status(enum.Enum):
    WAITING = 1
    RUNNING = 2
    FINISHED = 3
    RECEIVING = 4  # its prompt's KV is being pulled from a prefill server
    LOADING = 5  # part of its prefix is being read from a tier off the step loop (the disk)


class Request:
    __slots__ = (
        "request_id", "prompt_ids", "output_ids", "params", "num_computed", "tables",
        "status", "finish_reason", "arrival", "hit_tokens", "cached_tokens", "max_len",
        "sent_to_workers", "num_pending", "cache_node", "window_from", "full_kv_from",
        "replayed_tokens", "spec_in_flight", "spec_misses", "spec_backoff", "window_exact",
        "snapshot_hit", "prompt_logprobs_held", "prompt_logprobs_next", "cache_salt",
        "shortcuts",
    )

    def __init__(
        self, request_id: str, prompt_ids: np.ndarray, params: SamplingParams, arrival: int,
        max_len: int, num_groups: int = 1,
    ) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.output_ids: list[int] = []
        self.params = params
        self.cache_salt = 0  # its LoRA adapter's salt in the prefix cache's ids (0: the base)
        self.num_computed = 0  # tokens whose KV is in the cache
        self.tables: list[list[int]] = [[] for _ in range(num_groups)]  # per KV group
        self.cache_node = None  # pinned prefix-cache path (engine.kvcache.radix_cache.RadixNode)
        self.window_from = 0  # sliding-layer keys below this were never computed (replay)
        self.full_kv_from = 0  # full layers already hold K/V below this (prefix hit)
        self.replayed_tokens = 0  # recomputed for sliding windows after the last hit
        # Its sliding-window K/V is what a cold run computes (False after an approximate,
        # window-mode replay): only then may it leave snapshots for others.
        self.window_exact = True
        self.snapshot_hit = False  # its last admission resumed from a sliding-window snapshot
        self.status = Status.WAITING
        self.finish_reason: FinishReason | None = None
        self.arrival = arrival
        self.hit_tokens = 0  # tokens the current admission found cached (device or host)
        # Prompt tokens served from the cache, as the client sees it: fixed at the first
        # admission (a re-admission after preemption may also match its own outputs).
        self.cached_tokens: int | None = None
        self.max_len = max_len  # prompt + output may not exceed this (context, KV capacity)
        self.sent_to_workers = False
        # Tokens sampled by a step still in flight (overlap scheduling): known to the worker,
        # not yet to us.
        self.num_pending = 0
        self.spec_in_flight = False  # a speculating step is in flight: its new tokens unknown
        self.spec_misses = 0  # consecutive verify steps whose proposer found no draft
        self.spec_backoff = 0  # plain decode steps left before speculating again
        # Prompt logprobs received from the workers, held for the next delta, and the first
        # prompt position still without them (position 0 never has any).
        self.prompt_logprobs_held: list[PromptChunkLogprobs] = []
        self.prompt_logprobs_next = 1
        # What it took instead of a cold run of its own (prefix hits by tier, SWA replay, a
        # shared batch, ...): the exactness audit counts divergences by them.
        self.shortcuts: set[str] = set()

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def total_tokens(self) -> int:
        """Known tokens plus the ones being sampled right now."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    def length_exhausted(self) -> bool:
        """True when the tokens already known or in flight reach max_tokens or max_len."""
        return (len(self.output_ids) + self.num_pending >= self.params.max_tokens
                or self.total_tokens >= self.max_len)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    def tokens(self, start: int, end: int) -> np.ndarray:
        """Token ids [start, end) of prompt + output."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        out = np.asarray(self.output_ids[max(0, start - p): end - p], dtype=np.int32)
        if start >= p:
            return out
        return np.concatenate([self.prompt_ids[start:], out])

    def check_finished(self, eos_ids: tuple[int, ...]) -> FinishReason | None:
        """Finish reason after the newest output token, or None to keep going."""
        last = self.output_ids[-1]
        p = self.params
        if last in p.stop_token_ids or (not p.ignore_eos and last in eos_ids):
            return FinishReason.STOP
        if len(self.output_ids) >= p.max_tokens or self.num_tokens >= self.max_len:
            return FinishReason.LENGTH
        return None
