"""What the scheduler reports: cached tokens, host-tier counters, stop-string finishes."""

from __future__ import annotations

from deepinfer.engine.protocol import (
    FinishReason,
    SamplingParams,
    StepResult,
    TokenizedRequest,
    pack_ids,
)
from deepinfer.engine.scheduler.scheduler import Scheduler, SchedulerConfig


def config(**kw) -> SchedulerConfig:
    base = dict(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                prefill_chunk_size=64, context_len=256, eos_token_ids=(2,))
    return SchedulerConfig(**(base | kw))


def add(s: Scheduler, rid: str, prompt: list[int], max_tokens: int) -> None:
    assert s.add(TokenizedRequest(rid, pack_ids(prompt), SamplingParams(
        max_tokens=max_tokens, ignore_eos=True))) is None


def step(s: Scheduler, token: int = 7) -> list:
    plan = s.schedule()
    if plan is None:
        return []
    n = sum(seq.sample for _, seq in plan.scheduled)
    return s.update(plan, StepResult(plan.plan.step_id, pack_ids([token] * n)))


def test_cached_tokens_never_exceed_the_prompt_after_preemption():
    # 8 blocks of 4: two 8-token prompts growing to 28 tokens each cannot both fit, so the
    # newer one is preempted; its computed blocks (outputs included) are cached and its
    # re-admission matches more than its prompt.
    s = Scheduler(config(num_blocks=10))
    add(s, "a", list(range(10, 18)), 20)
    add(s, "b", list(range(30, 38)), 20)
    deltas = []
    while s.has_work():
        deltas += step(s)
    assert s.num_preemptions > 0
    assert s.kv.cache.hits_tokens > 8  # the re-admission matched past the prompt
    assert all(d.cached_tokens <= d.prompt_tokens == 8 for d in deltas)
    assert {d.cached_tokens for d in deltas if d.request_id == "b"} == {0}


def test_host_swap_ins_count_only_when_a_plan_carries_them():
    s = Scheduler(config(num_blocks=8, host_blocks=8))
    first = list(range(100, 120))  # 5 blocks
    add(s, "a", first, 1)
    while s.has_work():
        step(s)
    add(s, "evictor", list(range(200, 228)), 1)  # 7 blocks: a's blocks go to the host tier
    while s.has_work():
        step(s)
    assert s.stats().host_blocks_out > 0
    add(s, "hog", list(range(300, 312)), 40)  # holds 3+ blocks while it decodes
    step(s)
    add(s, "a-again", first, 1)  # its host blocks would fit, the rest of its prompt would not
    for _ in range(5):
        step(s)
    assert s.requests["a-again"].status.name == "WAITING"
    assert s.stats().host_blocks_in == 0 and s.stats().host_blocks_in == 0
    while s.has_work():
        step(s)
    assert s.stats().host_blocks_in > 0


def test_a_stop_string_finish_seeds_the_prefix_cache():
    s = Scheduler(config())
    prompt = list(range(10, 30))
    add(s, "a", prompt, 50)
    for _ in range(3):
        step(s)
    s.abort(["a"], FinishReason.STOP)  # the tokenizer matched a stop string
    add(s, "b", prompt, 1)
    deltas = step(s)
    assert deltas[0].cached_tokens == 16  # whole blocks of a's prompt


def test_an_abort_caches_nothing():
    s = Scheduler(config())
    prompt = list(range(10, 30))
    add(s, "a", prompt, 50)
    step(s)
    s.abort(["a"])
    add(s, "b", prompt, 1)
    assert step(s)[0].cached_tokens == 0
