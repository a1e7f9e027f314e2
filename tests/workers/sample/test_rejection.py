"""Verification of drafts: greedy matching, and rejection sampling held to the target's
distribution by chi-square tests (fixed seeds: each test is deterministic; the threshold,
p < 1e-3, is the false-alarm rate a fresh seed would have)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.protocol import SamplingParams
from deepinfer.workers.sample.rejection import Verification, verify
from deepinfer.workers.sample.sampler import Sampler, SamplingState

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


def run(p_rows: torch.Tensor, drafts_fn, n: int, seed: int = 0, batch: int = 1000,
        seeded: bool = False) -> list[list[int]]:
    """n verifications of drafts from drafts_fn against the fixed target rows, `batch` requests
    to a call (each its own rows, as in a real step); `seeded`: request i has seed i."""
    sampler = Sampler(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    rows = p_rows.shape[0]
    logits = p_rows.log().repeat(batch, 1)
    out = []
    for b in range(n // batch):
        seqs = [Verification(state(b * batch + i if seeded else None), *drafts_fn(gen),
                             i * rows) for i in range(batch)]
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


@pytest.mark.parametrize("seeded", [False, True])
def test_deterministic_drafts_keep_the_target_distribution(seeded):
    """An n-gram draft (no distribution): accepted with probability p(x) (Leviathan's
    rejection sampling, and the coupled verification of seeded requests alike), else the
    residual."""
    runs = run(P[:2], lambda gen: ([0], None), 10000, seeded=seeded)
    assert chi_square_p(counts_at(runs, 0), P[0]) > ALPHA
    assert chi_square_p(counts_at(runs, 1), P[1]) > ALPHA  # the bonus after an acceptance
    accepted = sum(len(t) == 2 for t in runs) / len(runs)
    assert abs(accepted - float(P[0, 0])) < 4.5 * (0.3 * 0.7 / len(runs)) ** 0.5


@pytest.mark.parametrize("seeded", [False, True])
def test_sampled_drafts_keep_the_target_distribution(seeded):
    q = torch.tensor([[0.05, 0.30, 0.05, 0.20, 0.10, 0.10, 0.10, 0.10],
                      [0.30, 0.10, 0.10, 0.10, 0.10, 0.10, 0.10, 0.10]])

    def draft(gen):
        tokens = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
        return tokens, q

    runs = run(P, draft, 12000, seed=3, seeded=seeded)
    for position in range(3):
        assert chi_square_p(counts_at(runs, position), P[position]) > ALPHA, position
    accepted = sum(len(t) - 1 for t in runs) / len(runs)
    # Some drafts accepted, some rejected (seeded: a draft drawn apart from the target's
    # uniform is accepted with probability sum(p * q) only).
    assert (0.05 if seeded else 0.2) < accepted < 1.8


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


def plain_draws(logits: torch.Tensor, seed: int, known: int, **params) -> list[int]:
    """What plain sampling (the batched sampler, one step per token) draws for a request seeded
    `seed` that has `known` output tokens, row j of `logits` giving output token known + j."""
    s = state(seed=seed, **params)
    s.output_ids = [0] * known
    out = []
    for j in range(logits.shape[0]):
        others = torch.randn(2, V, generator=torch.Generator().manual_seed(j))
        batch = torch.cat([others[:1], logits[j: j + 1], others[1:]])
        token = int(Sampler(j)(batch, [state(), s, state(seed=j)])[0][1])
        out.append(token)
        s.output_ids.append(token)
    return out


def test_seeded_verification_emits_what_plain_sampling_draws():
    """Coupled verification of a seeded request: the target's token at output k is drawn with
    u(seed, k) as plain sampling draws it, drafts are kept while they equal it. Any drafts
    (random, partly right, sampled with a distribution or not), any number of them, any batch:
    the text is that of plain sampling."""
    gen = torch.Generator().manual_seed(8)
    for trial in range(300):
        d = trial % 6
        logits = 2 * torch.randn(d + 1, V, generator=gen)
        seed, known = trial * 7919 - 1000, trial % 4
        params = dict(temperature=0.8, top_k=6) if trial % 3 else dict(temperature=1.2)
        ref = plain_draws(logits, seed, known, **params)
        right = int(torch.randint(0, d + 1, (1,), generator=gen))
        drafts = ref[:right] + torch.randint(0, V, (d - right,), generator=gen).tolist()
        q = torch.rand(d, V, generator=gen).softmax(-1) if trial % 2 else None
        s = state(seed=seed, **params)
        s.output_ids = [0] * known
        other = 2 * torch.randn(3, V, generator=gen)
        seqs = [Verification(state(), [1, 2], None, 0), Verification(s, drafts, q, 3)]
        (_, (tokens, _)) = verify(Sampler(trial), torch.cat([other, logits]), seqs)
        kept = next((j for j, x in enumerate(drafts) if x != ref[j]), d)
        assert tokens == ref[: kept + 1], trial


def test_seeded_drafts_share_the_targets_uniforms():
    """A seeded request's draft model draws draft k with u(seed, k) too (common random
    numbers): a draft distribution equal to the target's is always accepted; a different one
    is accepted exactly where both inverse CDFs agree (an exact overlap of their intervals:
    0.13 here, where rejection sampling would accept sum(min(p, q)) = 0.75), and what is
    emitted still follows the target."""
    from deepinfer.workers.spec_decode.base import Draft, DraftRequest, extend_drafts, finish_drafts

    q = torch.tensor([0.05, 0.05, 0.20, 0.0, 0.15, 0.10, 0.12, 0.33])
    p_cdf, q_cdf = P[0].cumsum(0), q.cumsum(0)
    lo = torch.maximum(p_cdf - P[0], q_cdf - q)
    overlap = float((torch.minimum(p_cdf, q_cdf) - lo).clamp(min=0).sum())
    sampler, n = Sampler(0), 6000
    for draft_logits, expected in ((P[0].log(), 1.0), (q.log(), overlap)):
        requests = [DraftRequest(str(seed), state(seed=seed), 3, 1) for seed in range(n)]
        drafts = [Draft([], []) for _ in requests]
        extend_drafts(sampler, requests, drafts, draft_logits.repeat(n, 1))
        seqs = [Verification(r.state, d.tokens, d.probs, 2 * i)
                for i, (r, d) in enumerate(zip(requests, finish_drafts(drafts)))]
        runs = [tokens for tokens, _ in verify(sampler, P[:2].log().repeat(n, 1), seqs)]
        rate = sum(len(t) == 2 for t in runs) / n
        assert abs(rate - expected) < 4.5 * (max(expected * (1 - expected), 1e-9) / n) ** 0.5
        assert chi_square_p(counts_at(runs, 0), P[0]) > ALPHA
