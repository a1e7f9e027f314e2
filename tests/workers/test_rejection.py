"""Verification of drafts: greedy matching, and rejection sampling held to the target's
distribution by chi-square tests (fixed seeds: each test is deterministic; the threshold,
p < 1e-3, is the false-alarm rate a fresh seed would have)."""

from __future__ import annotations

import pytest
import torch

from engine.protocol import SamplingParams
from workers.sample.rejection import Verification, verify
from workers.sample.sampler import Sampler, SamplingState

V = 8
ALPHA = 1e-3


def state(seed: int | None = None, **params) -> SamplingState:
    return SamplingState.create(SamplingParams(seed=seed, **params), torch.tensor([1, 2, 3]))


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of the observed counts under the expected distribution."""
    keep = probs > 0
    if int(counts[~keep].sum()):
        return 0.0  # a token of probability 0 was drawn
    expected = probs[keep] * counts.sum()
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


def test_greedy_accepts_while_drafts_match_the_argmax():
    logits = torch.full((4, V), -5.0)
    for row, best in enumerate([3, 5, 1, 6]):
        logits[row, best] = 5.0
    s = state(temperature=0.0)
    (tokens, _), = verify(Sampler(0), logits, [Verification(s, [3, 5, 2], None, 0)])
    assert tokens == [3, 5, 1]  # third draft rejected: the target's argmax instead
    (tokens, _), = verify(Sampler(0), logits, [Verification(s, [3, 5, 1], None, 0)])
    assert tokens == [3, 5, 1, 6]  # all accepted, plus the bonus token


def test_penalties_count_earlier_drafts_as_output():
    logits = torch.zeros(3, V)
    logits[:, 4] = 1.0
    logits[:, 2] = 0.5
    s = state(temperature=0.0, presence_penalty=1.0)
    (tokens, _), = verify(Sampler(0), logits, [Verification(s, [4, 4], None, 0)])
    assert tokens == [4, 2]  # row 1 sees draft 0 (token 4) as output: penalized below token 2


def run(p_rows: torch.Tensor, drafts_fn, n: int, seed: int = 0, batch: int = 1000
        ) -> list[list[int]]:
    """n verifications of drafts from drafts_fn against the fixed target rows, `batch` requests
    to a call (each its own rows, as in a real step)."""
    sampler = Sampler(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    rows = p_rows.shape[0]
    logits = p_rows.log().repeat(batch, 1)
    out = []
    for _ in range(n // batch):
        seqs = [Verification(state(), *drafts_fn(gen), i * rows) for i in range(batch)]
        out += [tokens for tokens, _ in verify(sampler, logits, seqs)]
    return out


def counts_at(runs: list[list[int]], position: int) -> torch.Tensor:
    c = torch.zeros(V)
    for tokens in runs:
        if len(tokens) > position:
            c[tokens[position]] += 1
    return c


P = torch.tensor([[0.30, 0.05, 0.20, 0.0, 0.15, 0.10, 0.12, 0.08],
                  [0.02, 0.40, 0.08, 0.20, 0.0, 0.10, 0.10, 0.10],
                  [0.125] * 8])


def test_deterministic_drafts_keep_the_target_distribution():
    """An n-gram draft (no distribution): accepted with probability p(x), else the residual."""
    runs = run(P[:2], lambda gen: ([0], None), 10000)
    assert chi_square_p(counts_at(runs, 0), P[0]) > ALPHA
    assert chi_square_p(counts_at(runs, 1), P[1]) > ALPHA  # the bonus after an acceptance


def test_sampled_drafts_keep_the_target_distribution():
    q = torch.tensor([[0.05, 0.30, 0.05, 0.20, 0.10, 0.10, 0.10, 0.10],
                      [0.30, 0.10, 0.10, 0.10, 0.10, 0.10, 0.10, 0.10]])

    def draft(gen):
        tokens = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
        return tokens, q

    runs = run(P, draft, 12000, seed=3)
    for position in range(3):
        assert chi_square_p(counts_at(runs, position), P[position]) > ALPHA, position
    accepted = sum(len(t) - 1 for t in runs) / len(runs)
    assert 0.2 < accepted < 1.8  # some drafts accepted, some rejected


def test_a_wrong_verifier_would_be_caught():
    """The test has power: accepting every draft gives q's distribution, which fails."""
    q = torch.tensor([0.05, 0.30, 0.05, 0.20, 0.10, 0.10, 0.10, 0.10])
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.multinomial(q, 20000, replacement=True, generator=gen),
                            minlength=V).float()
    assert chi_square_p(counts, P[0]) < ALPHA


@pytest.mark.parametrize("others", [0, 3])
def test_seeded_requests_do_not_depend_on_the_batch(others):
    logits = torch.randn(4 + 3 * others, V, generator=torch.Generator().manual_seed(5))
    def seqs(n: int) -> list[Verification]:
        mine = [Verification(state(seed=42, temperature=1.0), [1, 2, 3], None, 0)]
        return mine + [Verification(state(), [4, 5], None, 4 + 3 * i) for i in range(n)]

    alone = verify(Sampler(0), logits, seqs(0))[0][0]
    together = verify(Sampler(7), logits, seqs(others))[0][0]
    assert alone == together


def test_logprobs_for_every_emitted_token():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    s = state(temperature=0.0, logprobs=2)
    best = logits.argmax(-1).tolist()
    (tokens, lps), = verify(Sampler(0), logits, [Verification(s, best[:2], None, 0)])
    assert tokens == best and [lp.token_id for lp in lps] == best
    ref = logits.log_softmax(-1)
    assert all(abs(lp.logprob - float(ref[j, t])) < 1e-5 for j, (lp, t) in
               enumerate(zip(lps, tokens)))
    assert all(len(lp.top_ids) == 2 for lp in lps)


def test_a_tiny_temperature_verifies_as_greedy():
    """temperature 1e-40 is greedy (below 1e-5): drafts kept while they equal the argmax."""
    logits = torch.full((3, V), -1.0)
    for row, best in enumerate([3, 5, 1]):
        logits[row, best] = 2.0
    for seed in (None, 9):
        s = state(seed=seed, temperature=1e-40)
        (tokens, _), = verify(Sampler(0), logits, [Verification(s, [3, 4], None, 0)])
        assert tokens == [3, 5]
