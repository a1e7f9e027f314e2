"""The exactness audit (--audit-rate R): re-run a sampled fraction of finished requests cold and
count where their tokens or logprobs differ, by the shortcuts the originals took.

A request picked at admission (probability R) is watched: it gets a seed when it samples without
one (its draws are then u(seed, k), workers/sample/sampler.py, so a re-run draws the same
numbers; the distribution is unchanged) and its chosen tokens' logprobs are computed even when
the client did not ask (they are kept here, never sent). When it finishes normally, a job
holding its prompt, tokens and logprobs waits here. The scheduler runs a job only while no live
request exists, as a request of its own (an "audit-" id): no prefix-cache match or insert, no
KV connector (tiers, transfers), no speculation, so its sliding windows are computed, never
replayed. A live request arriving meanwhile ends the run (its work is dropped, the job starts
again later): an audit never shares a step with, or holds memory from, live traffic.

A re-run starts only after the server has had no live request for `idle_seconds` (a client
sending requests one after another leaves gaps of a few milliseconds: a re-run started in each
would be ended at once, having delayed the next request by a step for nothing).

A run compares its tokens and logprobs with the original's: the first position where a token
differs, or a logprob differs by more than the tolerance (0 with --deterministic: any bit), is a
divergence, counted once under each shortcut the original took (`Request.shortcuts`: prefix
hits by tier, SWA replay or snapshot, PD transfer, speculation, a shared batch; and the server's
own: KV dtype, quantization, LoRA), "none" when it took none. Pure logic, no sockets.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import msgspec
import numpy as np

from deepinfer.engine.protocol import (
    AuditDivergence,
    FinishReason,
    SampledLogprobs,
    SamplingParams,
    SchedulerStats,
)
from deepinfer.engine.request import Request

AUDIT_PREFIX = "audit-"  # the request id of a cold re-run: "audit-<n>-<original id>"
# Without --deterministic a batch of other shape computes each row's float32 sums in another
# order: logprobs move by ~1e-6 (tests hold every shortcut to 1e-4); a real fault moves more.
DEFAULT_TOLERANCE = 1e-3
LATEST = 32  # divergences kept for GET /v1/audit
MAX_JOBS = 64  # finished requests waiting for a re-run; later ones are not audited


@dataclass
class _Watched:
    forced_logprobs: bool  # the client did not ask for them: they stay here
    logprobs: list[float] = field(default_factory=list)


@dataclass
class AuditJob:
    request_id: str  # the original's
    prompt: np.ndarray
    params: SamplingParams  # the cold re-run's
    salt: int
    tokens: list[int]
    logprobs: list[float]
    shortcuts: tuple[str, ...]
    run_logprobs: list[float] = field(default_factory=list)  # the cold run's, as it goes


def compare(tokens: list[int], logprobs: list[float], ref_tokens: list[int],
            ref_logprobs: list[float], tolerance: float) -> tuple[int | None, float]:
    """(first position where the two runs differ, or None; the largest difference of the chosen
    tokens' logprobs up to the first position whose tokens differ, that one included). Lengths
    differing is a difference at the shorter's end."""
    first, largest = None, 0.0
    for i, (a, b) in enumerate(zip(tokens, ref_tokens)):
        if i < len(logprobs) and i < len(ref_logprobs):
            gap = abs(logprobs[i] - ref_logprobs[i])
            gap = gap if gap == gap else float("inf")  # NaN: as far as it gets
            largest = max(largest, gap)
            if gap > tolerance and first is None:
                first = i
        if a != b:
            first = i if first is None else first
            break
    if first is None and len(tokens) != len(ref_tokens):
        first = min(len(tokens), len(ref_tokens))
    return first, largest


class Auditor:
    def __init__(self, rate: float, deterministic: bool = False,
                 server_shortcuts: tuple[str, ...] = (), tolerance: float | None = None,
                 seed: int = 0, idle_seconds: float = 0.5) -> None:
        self.rate = rate
        self.deterministic = deterministic
        self.server_shortcuts = server_shortcuts  # KV dtype, quantization: every request's
        self.tolerance = (0.0 if deterministic else DEFAULT_TOLERANCE) if tolerance is None \
            else tolerance
        self._random = random.Random(seed)
        self.idle_seconds = idle_seconds
        self._idle_since: float | None = None  # no live request since then
        self._watched: dict[str, _Watched] = {}
        self.jobs: deque[AuditJob] = deque()
        self.run: tuple[AuditJob, Request] | None = None
        self._runs = 0
        self.requests = 0  # re-runs compared
        self.divergences: dict[str, int] = {}
        self.largest_gap = 0.0
        self.latest: deque[AuditDivergence] = deque(maxlen=LATEST)
        self.found: list[AuditDivergence] = []  # since the last `take_found` (for the log)

    # ------------------------------------------------------------------ originals

    def watch(self, req: Request) -> None:
        """On admission: pick the request with probability `rate` (not prompt scoring, not
        structured output: a re-run would need its grammar compiled again)."""
        p = req.params
        if (self.rate <= 0 or p.max_tokens == 0 or p.grammar is not None
                or req.request_id.startswith(AUDIT_PREFIX)
                or self._random.random() >= self.rate):
            return
        changes = {}
        if p.seed is None and not p.is_greedy():
            changes["seed"] = self._random.getrandbits(63)
        if p.logprobs is None:
            changes["logprobs"] = 0
        if changes:
            req.params = msgspec.structs.replace(p, **changes)
        self._watched[req.request_id] = _Watched(forced_logprobs=p.logprobs is None)

    def is_run(self, req: Request) -> bool:
        return self.run is not None and self.run[1] is req

    def observe(self, req: Request, logprobs: list[SampledLogprobs | None]
                ) -> list[SampledLogprobs] | None:
        """A step's kept tokens' logprobs for `req`: what its delta carries (None: an audit's
        own run, which sends no delta)."""
        sent = [lp for lp in logprobs if lp]
        watched = self._watched.get(req.request_id)
        if self.is_run(req):
            self.run[0].run_logprobs.extend(lp.logprob for lp in sent)
            return None
        if watched is None:
            return sent
        watched.logprobs.extend(lp.logprob for lp in sent)
        return [] if watched.forced_logprobs else sent

    def finished(self, req: Request, reason: FinishReason) -> None:
        """A request ended: a watched one that finished normally becomes a job; an audit's run
        that finished is compared, one that was ended (live traffic came) waits again."""
        if self.is_run(req):
            job, _ = self.run
            self.run = None
            if reason in (FinishReason.STOP, FinishReason.LENGTH):
                self._compare(job, req)
            elif reason == FinishReason.ABORT:
                self.jobs.appendleft(job)
            return
        watched = self._watched.pop(req.request_id, None)
        if watched is None or reason not in (FinishReason.STOP, FinishReason.LENGTH):
            return
        if len(self.jobs) >= MAX_JOBS or not req.output_ids:
            return
        p = req.params
        cold = msgspec.structs.replace(
            p, max_tokens=len(req.output_ids), speculative=False, remote_prefill=None,
            remote_decode=False, prompt_logprobs=None, stop=[], logprobs=0)
        shortcuts = tuple(sorted(req.shortcuts | set(self.server_shortcuts)
                                 | ({"lora"} if p.lora is not None else set())))
        self.jobs.append(AuditJob(req.request_id, req.prompt_ids, cold, req.cache_salt,
                                  list(req.output_ids), watched.logprobs, shortcuts))

    # ------------------------------------------------------------------ re-runs

    def has_jobs(self) -> bool:
        return bool(self.jobs)

    def idle(self, idle_now: bool, now: float) -> bool:
        """Whether a re-run may run: the server has had no live request for idle_seconds."""
        if not idle_now:
            self._idle_since = None
            return False
        if self._idle_since is None:
            self._idle_since = now
        return now - self._idle_since >= self.idle_seconds

    def next_start(self) -> float | None:
        """When a waiting job may start (None: none waits, or one runs, or not idle)."""
        if not self.jobs or self.run is not None or self._idle_since is None:
            return None
        return self._idle_since + self.idle_seconds

    def start(self, arrival: int, max_len: int, num_groups: int) -> Request | None:
        """The next job's cold run as a request (None: no job)."""
        if not self.jobs or self.run is not None:
            return None
        job = self.jobs.popleft()
        self._runs += 1
        req = Request(f"{AUDIT_PREFIX}{self._runs}-{job.request_id}", job.prompt, job.params,
                      arrival, max_len, num_groups)
        req.cache_salt = job.salt
        job.run_logprobs = []
        self.run = (job, req)
        return req

    def _compare(self, job: AuditJob, req: Request) -> None:
        first, gap = compare(job.tokens, job.logprobs, list(req.output_ids),
                             job.run_logprobs, self.tolerance)
        self.requests += 1
        self.largest_gap = max(self.largest_gap, gap)
        if first is None:
            return
        for shortcut in job.shortcuts or ("none",):
            self.divergences[shortcut] = self.divergences.get(shortcut, 0) + 1
        found = AuditDivergence(job.request_id, list(job.shortcuts) or ["none"], first, gap,
                                len(job.tokens))
        self.latest.append(found)
        self.found.append(found)

    def take_found(self) -> list[AuditDivergence]:
        found, self.found = self.found, []
        return found

    def fill_stats(self, stats: SchedulerStats) -> None:
        stats.audit_requests = self.requests
        stats.audit_divergences = dict(self.divergences)
        stats.audit_largest_logprob_diff = self.largest_gap
        stats.audit_pending = len(self.jobs) + (self.run is not None)
        stats.audit_latest = list(self.latest)
