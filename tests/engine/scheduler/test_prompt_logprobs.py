"""The scheduler's side of prompt logprobs: which chunks ask, no cached prefix while some are
missing, every position once on the first delta (even across a preemption), max_tokens 0."""

from __future__ import annotations

import numpy as np

from deepinfer.engine.protocol import (
    FinishReason,
    PromptChunkLogprobs,
    SamplingParams,
    StepResult,
    TokenizedRequest,
    pack_ids,
    unpack_ids,
)
from deepinfer.engine.scheduler.scheduler import Scheduler, SchedulerConfig

PROMPT = list(range(100, 130))  # 30 tokens


def make(prefix_caching: bool = False, chunk: int = 8, num_blocks: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks, 4, 8, 16, chunk, 1024, (2,),
                                     prefix_caching=prefix_caching))


def add(s: Scheduler, rid: str, prompt=PROMPT, **params) -> None:
    assert s.add(TokenizedRequest(rid, pack_ids(prompt), SamplingParams(**params))) is None


def worker_step(s: Scheduler, token: int = 7):
    """One step as a worker answers it: a piece per asking seq whose logprob at prompt
    position p is -p (so where each number came from shows)."""
    step = s.schedule()
    assert step is not None
    pieces = []
    for req, seq in step.scheduled:
        if seq.prompt_logprobs:
            start = seq.start_pos + 1
            end = min(seq.start_pos + len(unpack_ids(seq.token_ids)), req.num_prompt - 1)
            positions = np.arange(start, end + 1)
            pieces.append(PromptChunkLogprobs(start, (-positions).astype(np.float32).tobytes(),
                                              np.ones_like(positions, np.int32).tobytes()))
    n_sample = sum(seq.sample for _, seq in step.scheduled)
    result = StepResult(step.plan.step_id, pack_ids([token] * n_sample), prompt_logprobs=pieces)
    return step, s.update(step, result)


def positions(pieces: list[PromptChunkLogprobs]) -> list[int]:
    """The positions the pieces cover, checked against the numbers they carry."""
    out = []
    for p in pieces:
        got = np.frombuffer(p.logprobs, np.float32)
        assert got.tolist() == [-float(p.start + j) for j in range(p.count)]
        out += range(p.start, p.start + p.count)
    return out


def test_every_chunk_asks_and_the_first_delta_carries_all():
    s = make()
    add(s, "a", max_tokens=3, prompt_logprobs=2)
    add(s, "b", prompt=[5, 6, 7], max_tokens=3)  # did not ask: no flag, no pieces
    deltas = []
    while s.has_work():
        step, ds = worker_step(s)
        for req, seq in step.scheduled:
            prefill = seq.start_pos < req.num_prompt
            assert seq.prompt_logprobs == (req.request_id == "a" and prefill)
        deltas += [d for d in ds if d.request_id == "a"]
    assert len(deltas) == 3
    assert positions(deltas[0].prompt_logprobs) == list(range(1, 30))
    assert all(not d.prompt_logprobs for d in deltas[1:])


def test_no_cached_prefix_while_prompt_logprobs_are_missing():
    s = make(prefix_caching=True)
    add(s, "first", max_tokens=1)
    while s.has_work():
        worker_step(s)
    add(s, "scored", max_tokens=1, prompt_logprobs=0)
    step, _ = worker_step(s)
    assert step.scheduled[0][1].start_pos == 0  # the whole prompt is computed
    while s.has_work():
        _, deltas = worker_step(s)
    assert deltas[0].cached_tokens == 0
    assert positions(deltas[0].prompt_logprobs) == list(range(1, 30))
    add(s, "plain", max_tokens=1)  # the same prompt without them does hit the cache
    step, _ = worker_step(s)
    assert step.scheduled[0][1].start_pos > 0


def test_preempted_mid_prefill_each_position_arrives_once():
    s = make(prefix_caching=True)
    add(s, "a", max_tokens=2, prompt_logprobs=1)
    worker_step(s)  # positions 0..7 computed: pieces for 1..8
    s._preempt(s.requests["a"])  # recomputed from 0 (and no cached prefix: some are missing)
    deltas = []
    while s.has_work():
        step, ds = worker_step(s)
        deltas += ds
    assert s.num_preemptions == 1
    assert positions(deltas[0].prompt_logprobs) == list(range(1, 30))


def test_max_tokens_zero_scores_the_prompt_and_outputs_nothing():
    s = make()
    add(s, "a", max_tokens=0, prompt_logprobs=0)
    deltas = []
    while s.has_work():
        _, ds = worker_step(s)
        deltas += ds
    assert len(deltas) == 1
    d = deltas[0]
    assert d.finish_reason == FinishReason.LENGTH and unpack_ids(d.token_ids).size == 0
    assert positions(d.prompt_logprobs) == list(range(1, 30))
    assert s.generation_tokens_total == 0
    assert s.kv.num_reusable() == s.kv.num_total()


def test_a_one_token_prompt_asks_nothing():
    s = make()
    add(s, "a", prompt=[42], max_tokens=1, prompt_logprobs=3)
    step, deltas = worker_step(s)
    assert not step.scheduled[0][1].prompt_logprobs
    assert deltas[0].prompt_logprobs == []


def test_a_recomputed_piece_is_trimmed_to_what_is_missing():
    ids = np.arange(12, dtype=np.int32).reshape(4, 3)  # 4 positions, top 3
    piece = PromptChunkLogprobs(5, np.arange(4, dtype=np.float32).tobytes(),
                                np.arange(4, dtype=np.int32).tobytes(), ids.tobytes(),
                                ids.astype(np.float32).tobytes())
    tail = piece.since(7)
    assert (tail.start, tail.count) == (7, 2)
    assert np.frombuffer(tail.logprobs, np.float32).tolist() == [2.0, 3.0]
    assert np.frombuffer(tail.top_ids, np.int32).tolist() == list(range(6, 12))
    assert piece.since(3) is piece and piece.since(9).count == 0
