"""Sampling against exact references: formulas, supports, frequencies, seeds."""

from __future__ import annotations

import torch

from deepinfer.engine.protocol import SamplingParams
from deepinfer.workers.sample.sampler import Sampler, SamplingState, apply_penalties, seeded_uniform


def state(prompt=(1, 2), output=(), **params) -> SamplingState:
    s = SamplingState.create(SamplingParams(**params), torch.tensor(prompt))
    s.output_ids = list(output)
    return s


def test_penalties_match_their_definitions():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])
    s = state(prompt=(0, 1), output=(3, 3, 4), repetition_penalty=2.0,
              frequency_penalty=0.5, presence_penalty=0.25)
    got = apply_penalties(logits.clone(), [s])[0]
    # repetition (HF): seen tokens {0,1,3,4}: positive / 2, negative * 2
    expected = torch.tensor([1.0, -2.0, 0.5, 1.5, 0.5])
    # frequency/presence on output tokens only: 3 twice, 4 once
    expected[3] -= 0.5 * 2 + 0.25
    expected[4] -= 0.5 * 1 + 0.25
    assert torch.allclose(got, expected)


def test_greedy_equivalents():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    sampler = Sampler(0)
    states = [state(temperature=0.0), state(top_k=1), state(top_p=1e-6), state(min_p=1.0)]
    tokens, _ = sampler(logits, states)
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_sampling_frequencies_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    tokens, _ = Sampler(1)(logits, [state(temperature=1.0) for _ in range(4000)])
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert (freq - probs).abs().max() < 0.03


def test_top_k_top_p_min_p_restrict_the_support():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log().repeat(2000, 1)
    sampler = Sampler(2)
    k2, _ = sampler(logits, [state(top_k=2) for _ in range(2000)])
    assert set(k2.tolist()) == {0, 1}
    p65, _ = sampler(logits, [state(top_p=0.65) for _ in range(2000)])
    assert set(p65.tolist()) == {0, 1}  # 0.4 < 0.65, 0.4 + 0.3 >= 0.65
    mp, _ = sampler(logits, [state(min_p=0.6) for _ in range(2000)])
    assert set(mp.tolist()) == {0, 1}  # keeps p >= 0.6 * 0.4 = 0.24


def test_seeded_requests_do_not_depend_on_the_batch():
    torch.manual_seed(3)
    row = torch.randn(1, 100)
    others = torch.randn(5, 100)

    def draws(batch_with_others: bool) -> list[int]:
        sampler = Sampler(99 if batch_with_others else 7)
        s = state(seed=1234, temperature=1.0)
        out = []
        for _ in range(20):
            if batch_with_others:
                batch = torch.cat([others[:2], row, others[2:]])
                states = [state(), state(), s, state(), state(), state()]
                tok = sampler(batch, states)[0][2]
            else:
                tok = sampler(row, [s])[0][0]
            out.append(int(tok))
            s.output_ids.append(int(tok))
        return out

    alone, shared = draws(False), draws(True)
    assert alone == shared
    assert len(set(alone)) > 1  # it really sampled


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    tokens, lps = Sampler(0)(logits, [state(temperature=0.0, logprobs=2)])
    ref = logits.log_softmax(-1)[0]
    lp = lps[0]
    assert lp.token_id == 2 and abs(lp.logprob - ref[2].item()) < 1e-6
    assert lp.top_ids == [2, 1] and torch.allclose(torch.tensor(lp.top_logprobs), ref[[2, 1]])


def test_a_tiny_temperature_is_greedy():
    """Below 1e-5 the temperature means greedy (as in vLLM): dividing by 1e-40 overflows to
    inf and NaN probabilities, which would pick the last vocabulary id."""
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0, 0.0]] * 3)
    states = [state(temperature=1e-40), state(temperature=1e-6, seed=3), state(temperature=0.0)]
    tokens, _ = Sampler(0)(logits, states)
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_a_seeded_draw_depends_on_its_seed_and_output_index_only():
    """Prefill/decode disaggregation: a decode server's request starts with the first token the
    prefill server sampled; its next tokens must be those one server would have sampled."""
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(5))
    one = state(seed=-77, temperature=1.0)
    for row in logits:
        one.output_ids.append(int(Sampler(0)(row[None], [one])[0][0]))
    decode = state(seed=-77, temperature=1.0, output=one.output_ids[:1])
    for row in logits[1:]:
        decode.output_ids.append(int(Sampler(1)(row[None], [decode])[0][0]))
    assert decode.output_ids == one.output_ids
    assert len(set(one.output_ids)) > 1


def test_seeded_uniforms_are_splitmix64():
    """u(seed, k) is SplitMix64's output k from state `seed` (the reference implementation's
    outputs for seed 1234567), its top 53 bits; a negative seed is its two's complement."""
    ref = [6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431,
           16408922859458223821]
    assert [seeded_uniform(1234567, k) for k in range(5)] == [(x >> 11) / 2**53 for x in ref]
    assert seeded_uniform(-5, 2) == seeded_uniform(2**64 - 5, 2)


def test_a_rows_distribution_does_not_depend_on_another_rows_min_p():
    """Only rows that ask for min-p are renormalized after it: a seeded row's probabilities,
    and so its draw, are bit for bit the same beside a min-p request."""
    from deepinfer.workers.sample.sampler import processed_probs

    logits = torch.randn(2, 1000, generator=torch.Generator().manual_seed(2))
    mine = state(seed=1, temperature=0.7)
    alone = processed_probs(logits[:1], [mine])
    beside = processed_probs(logits, [mine, state(min_p=0.05)])
    assert torch.equal(beside[0], alone[0])
