"""Prefill/decode disaggregation in the scheduler: which blocks a prefill holds and frees, which
a decode pulls, and that every way out (confirmation, timeout, abort, failure) frees them. No
model, no processes (tests/e2e/test_disaggregation.py runs the real thing)."""

from __future__ import annotations

import msgspec

from deepinfer.engine.kv_layout import FULL, SLIDING, KVGroup
from deepinfer.engine.protocol import (
    FinishReason,
    KVTransferDone,
    KVTransferParams,
    SamplingParams,
    StepResult,
    TokenizedRequest,
    TransferWork,
    pack_ids,
    unpack_ids,
)
from deepinfer.engine.request import Status
from deepinfer.engine.scheduler.scheduler import Scheduler, SchedulerConfig

BS = 4
PROMPT = list(range(10, 10 + 4 * BS + 2))  # 18 tokens: 4 full blocks and 2 in a fifth


FULL_ONLY = (KVGroup(FULL),)


def make(groups=FULL_ONLY, ranks=1, hold=60.0, blocks=32) -> Scheduler:
    return Scheduler(SchedulerConfig(blocks, BS, 8, 64, 64, 1024, (2,), kv_groups=groups,
                                     worker_ranks=ranks, kv_hold_timeout=hold))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(s: Scheduler, tokens: list[int] | None = None):
    step = s.schedule()
    assert step is not None
    n = sum(seq.sample for _, seq in step.scheduled)
    return step, s.update(step, StepResult(step.plan.step_id, pack_ids((tokens or [7]) * n)))


def transfer(s: Scheduler):
    """The scheduler's prefill/decode transfer connector."""
    (found,) = [c for c in s.connectors if c.name == "transfer"]
    return found


def work(step) -> TransferWork:
    """The transfer connector's entry in a step plan (an empty one when it has none)."""
    return step.plan.connectors.get("transfer", TransferWork())


def free(s: Scheduler) -> int:
    return s.kv.num_reusable()


def prefill(s: Scheduler, rid: str = "p", prompt=PROMPT):
    s.add(TokenizedRequest(rid, pack_ids(prompt), SamplingParams(max_tokens=1,
                                                                 remote_decode=True)))
    _, deltas = run(s, [42])
    (delta,) = deltas
    assert delta.finish_reason == FinishReason.LENGTH and delta.kv_transfer is not None
    return delta.kv_transfer


def test_a_prefill_holds_its_blocks_until_every_rank_confirms():
    s = make(ranks=2)
    held = prefill(s)
    assert held.num_tokens == len(PROMPT) and held.first_token == 42
    assert len(held.block_ids[0]) == 5  # the prompt's 5 blocks (room for no more)
    # Held blocks are not reusable (the prefix cache has the 4 full ones too, locked).
    assert free(s) == 32 - 5
    s.connector_report(KVTransferDone(held.transfer_id, rank=0, blocks=5, bytes=100))
    assert free(s) == 32 - 5 and transfer(s).pending == 1
    s.connector_report(KVTransferDone(held.transfer_id, rank=1, blocks=5, bytes=100))
    assert free(s) == 32 and transfer(s).pending == 0
    assert s.stats().kv_transfer_blocks == 5 and s.stats().kv_transfer_bytes == 200
    # The next plan tells the ranks to refuse late reads of it.
    s.add(TokenizedRequest("q", pack_ids([5, 6, 7]), SamplingParams(max_tokens=1)))
    step, _ = run(s)
    assert work(step).released == [held.transfer_id]


def test_held_blocks_are_freed_after_the_hold_timeout_or_a_client_abort():
    s = make(hold=5.0)
    clock = Clock()
    transfer(s).clock = clock
    first = prefill(s, "a")
    clock.now = 3.0
    prefill(s, "b", [99] + PROMPT[1:])
    clock.now = 5.5  # "a" timed out, "b" not yet
    step = s.schedule()  # nothing to compute: the ranks learn of "b" and forget "a"
    assert not step.plan.seqs and [h.transfer_id for h in work(step).held] == ["b"]
    assert work(step).released == [first.transfer_id]
    assert list(transfer(s).held) == ["b"] and transfer(s).expired == 1
    s.abort(["b"])  # its client went away: nothing will pull it
    assert free(s) == 32 and not transfer(s).held
    assert transfer(s).plan_entry().released == ["b"]


def test_the_ranks_learn_which_blocks_a_transfer_holds_in_the_next_plan():
    """A transfer socket serves only blocks of transfers held now: the plan after the hold
    names them (the first plan even with nothing to compute)."""
    s = make()
    held = prefill(s)
    assert transfer(s).has_plan()
    step = s.schedule()
    assert step is not None and not step.plan.seqs
    (hold,) = work(step).held
    assert hold.transfer_id == held.transfer_id
    assert [unpack_ids(b).tolist() for b in hold.blocks] == held.block_ids


def test_a_released_or_expired_hold_reaches_the_ranks_in_a_plan_of_its_own():
    """A rank serves reads of a transfer until a plan says it was released: on an idle server
    that plan must go out at once, not with the next request (a replayed pull was served
    meanwhile)."""
    s = make(hold=5.0)
    clock = Clock()
    transfer(s).clock = clock
    done, late = prefill(s, "done"), prefill(s, "late", [99] + PROMPT[1:])
    s.schedule()  # the ranks learn of both holds
    s.connector_report(KVTransferDone(done.transfer_id, rank=0, blocks=5, bytes=100))
    step = s.schedule()
    assert step is not None and not step.plan.seqs
    assert work(step).released == [done.transfer_id]
    clock.now = 6.0  # "late" timed out: nobody came for it
    step = s.schedule()
    assert step is not None and work(step).released == [late.transfer_id]
    assert free(s) == 32 and s.schedule() is None


def test_a_stop_by_eos_or_a_longer_request_holds_nothing():
    s = make()
    s.add(TokenizedRequest("eos", pack_ids(PROMPT), SamplingParams(max_tokens=1,
                                                                   remote_decode=True)))
    _, (delta,) = run(s, [2])  # EOS on the first token: the request is over
    assert delta.finish_reason == FinishReason.STOP and delta.kv_transfer is None
    s.add(TokenizedRequest("plain", pack_ids(PROMPT), SamplingParams(max_tokens=1)))
    _, (delta,) = run(s, [42])
    assert delta.kv_transfer is None and free(s) == 32


def remote(held: KVTransferParams) -> KVTransferParams:
    return KVTransferParams(do_remote_prefill=True, transfer_id=held.transfer_id,
                            addresses=["tcp://x:1#n"], block_ids=held.block_ids,
                            num_tokens=held.num_tokens, block_size=held.block_size,
                            first_token=held.first_token, first_logprobs=held.first_logprobs,
                            kv_dtype=held.kv_dtype, prompt_digest=held.prompt_digest)


def decode_request(s: Scheduler, held: KVTransferParams, rid: str = "d", max_tokens: int = 4):
    return s.add(TokenizedRequest(rid, pack_ids(PROMPT), SamplingParams(
        max_tokens=max_tokens, remote_prefill=remote(held))))


def pulled(step) -> list[list[tuple[int, int]]]:
    (pull,) = work(step).pulls
    return [unpack_ids(b).reshape(-1, 2).tolist() for b in pull.blocks]


def test_a_decode_pulls_the_prompt_then_runs_from_the_first_token():
    p, d = make(), make()
    held = prefill(p)
    assert decode_request(d, held) is None
    step = d.schedule()  # nothing to compute, but the plan carries the pull
    assert step is not None and not step.plan.seqs
    req = d.requests["d"]
    assert req.status == Status.RECEIVING
    (pairs,) = pulled(step)
    assert [r for r, _ in pairs] == held.block_ids[0]
    assert [loc for _, loc in pairs] == req.tables[0][:5]
    assert len(req.tables[0]) == 5  # 18 prompt tokens + the first token fit in 5 blocks
    d.update(step, StepResult(step.plan.step_id, b""))
    assert d.schedule() is None  # still receiving: nothing runs
    delta = d.connector_report(KVTransferDone("d", rank=0, blocks=5, bytes=80, seconds=0.01))
    assert unpack_ids(delta.token_ids).tolist() == [42] and delta.prompt_tokens == len(PROMPT)
    step, _ = run(d, [43])
    (seq,) = step.plan.seqs
    assert seq.start_pos == len(PROMPT) and unpack_ids(seq.token_ids).tolist() == [42]
    (new,) = step.plan.new_requests
    assert unpack_ids(new.output_ids).tolist() == [42]  # the worker knows the first token
    assert d.requests["d"].output_ids == [42, 43]
    assert d.stats().kv_transfer_count == 1


def test_a_decode_reuses_its_own_prefix_cache_and_pulls_only_the_rest():
    p, d = make(), make()
    # The decode server already computed the prompt's first 3 blocks for another request.
    d.add(TokenizedRequest("warm", pack_ids(PROMPT[:3 * BS + 1]), SamplingParams(max_tokens=1)))
    run(d)
    held = prefill(p)
    decode_request(d, held)
    step = d.schedule()
    (pairs,) = pulled(step)
    assert [r for r, _ in pairs] == held.block_ids[0][3:]
    assert d.requests["d"].cached_tokens == 3 * BS


def test_a_sliding_window_model_moves_only_the_window():
    window = 6  # a query after 18 tokens sees keys 13..18: blocks 3 and 4
    groups = (KVGroup(FULL), KVGroup(SLIDING, window))
    p, d = make(groups), make(groups)
    held = prefill(p)
    decode_request(d, held)
    step = d.schedule()
    full, sliding = pulled(step)
    assert len(full) == 5 and [r for r, _ in sliding] == held.block_ids[1][3:5]
    req = d.requests["d"]
    assert req.tables[1][:3] == [-1, -1, -1] and req.window_from == 3 * BS


def test_a_failed_pull_fails_the_request_and_frees_its_blocks():
    p, d = make(), make(ranks=2)
    decode_request(d, prefill(p))
    d.schedule()
    assert d.connector_report(KVTransferDone("d", rank=1, error="no answer")) is None
    assert free(d) < 32  # rank 0 may still be writing
    delta = d.connector_report(KVTransferDone("d", rank=0, blocks=5))
    assert delta.finish_reason == FinishReason.ERROR and "no answer" in delta.error
    assert free(d) == 32 and "d" not in d.requests


def test_an_abort_during_the_pull_frees_blocks_once_the_ranks_stop_writing():
    p, d = make(), make()
    decode_request(d, prefill(p))
    step = d.schedule()
    d.update(step, StepResult(step.plan.step_id, b""))
    d.abort(["d"])
    assert free(d) < 32  # the rank may be writing into them
    step = d.schedule()  # nothing to compute, but the ranks must hear of it
    assert step is not None and work(step).cancels == ["d"]
    assert d.connector_report(KVTransferDone("d", rank=0, cancelled=True)) is None
    assert free(d) == 32 and not transfer(d).receiving


def test_kv_computed_for_another_prompt_is_refused():
    """The blocks a decode server pulls enter its prefix cache under its request's prompt:
    parameters made for another prompt of the same length (the prefix-cache poisoning a
    review found) are refused before anything is pulled."""
    p, d = make(), make()
    held = prefill(p, prompt=[99] + PROMPT[1:])
    refused = decode_request(d, held)
    assert refused.finish_reason == FinishReason.ERROR and "another prompt" in refused.error
    assert not transfer(d).receiving and d.kv.cache.num_cached_blocks == 0


def test_a_first_token_outside_the_vocabulary_is_refused():
    p = make()
    d = Scheduler(SchedulerConfig(32, BS, 8, 64, 64, 1024, (2,), vocab_size=100))
    held = prefill(p)
    bad = remote(held)
    bad.first_token = 100
    refused = d.add(TokenizedRequest("d", pack_ids(PROMPT), SamplingParams(remote_prefill=bad)))
    assert refused.finish_reason == FinishReason.ERROR and "vocabulary" in refused.error


def test_an_abort_before_admission_releases_the_prefill_servers_hold():
    """A decode request still waiting for room when its client leaves tells the prefill
    server at once (an abandoning pull) instead of leaving its blocks held until the hold
    timeout."""
    p, d = make(), make(blocks=8)
    held = prefill(p)
    d.add(TokenizedRequest("big", pack_ids(list(range(100, 100 + 5 * BS))),
                           SamplingParams(max_tokens=8)))
    run(d)  # "big" holds 6 of the 8 blocks
    decode_request(d, held)
    step, _ = run(d)  # no room for the decode's 5 blocks: it waits
    assert d.requests["d"].status == Status.WAITING and not work(step).pulls
    d.abort(["d"])
    step = d.schedule()
    (pull,) = work(step).pulls
    assert (pull.request_id, pull.transfer_id, pull.abandon, pull.blocks) == \
        ("d", held.transfer_id, True, [])
    assert transfer(d).receiving == {}  # nothing of ours is being written


def test_a_mismatched_or_incomplete_transfer_is_refused_up_front():
    p, d = make(), make()
    held = prefill(p)
    other = d.add(TokenizedRequest("x", pack_ids(PROMPT[:-1]), SamplingParams(
        remote_prefill=remote(held))))
    assert other.finish_reason == FinishReason.ERROR and "prompt tokens" in other.error
    gone = remote(held)
    gone.block_ids = [[*held.block_ids[0][:2], -1, *held.block_ids[0][3:]]]
    refused = d.add(TokenizedRequest("y", pack_ids(PROMPT), SamplingParams(remote_prefill=gone)))
    assert "no longer holds" in refused.error
    assert held.kv_dtype == "float32"  # the prefill server's cache type travels with its KV
    other_type = remote(held)
    other_type.kv_dtype = "float16"  # a prefill server with --kv-cache-dtype float16
    refused = d.add(TokenizedRequest("z", pack_ids(PROMPT), SamplingParams(
        remote_prefill=other_type)))
    assert refused.finish_reason == FinishReason.ERROR and "--kv-cache-dtype" in refused.error


def test_kv_computed_with_another_lora_adapter_is_refused():
    """The held KV names the adapter it was computed with (its salt, signed with the rest):
    a decode server continues it only under the same adapter's files."""
    def lora_server(salt: int) -> Scheduler:
        return Scheduler(SchedulerConfig(32, BS, 8, 64, 64, 1024, (2,), lora_salts={"a": salt}))

    p = lora_server(5)
    p.add(TokenizedRequest("p", pack_ids(PROMPT), SamplingParams(
        max_tokens=1, remote_decode=True, lora="a")))
    (delta,) = run(p, [42])[1]
    held = delta.kv_transfer
    assert held.cache_salt == 5
    params = msgspec.structs.replace(held, addresses=["tcp://x:1#n"])
    for server, lora, refused in ((lora_server(5), "a", False), (lora_server(6), "a", True),
                                  (lora_server(5), None, True)):
        answer = server.add(TokenizedRequest("d", pack_ids(PROMPT), SamplingParams(
            max_tokens=4, remote_prefill=params, lora=lora)))
        if refused:
            assert answer.finish_reason == FinishReason.ERROR
            assert "another LoRA adapter" in answer.error
        else:
            assert answer is None and server.requests["d"].cache_salt == 5
