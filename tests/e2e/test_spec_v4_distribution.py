"""Sampling with DeepSeek-V4's MTP layer and with DSpark keeps the target's distribution (the
per-position chi-square test tests/e2e/test_spec_distribution.py holds the draft model to), and a
seeded request's text does not depend on its batch.

A 16-token DeepSeek-V4 (random; its MTP layer and a DSpark drafter random too, so many drafts
are rejected and the residual distribution is exercised) makes the exact distributions
computable: transformers gives the target's probability of every continuation.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from scripts.tiny_models import add_dspark_weights, add_mtp_weights, save_tiny_model
from tests.e2e.test_spec_decode import same_draws
from tests.e2e.test_spec_distribution import PROMPT, V, marginals
from tests.workers.sample.test_rejection import chi_square_p

N = 1000  # (3000 passed too: 5-6 minutes a method)


@pytest.fixture(scope="module")
def v4_small(tmp_path_factory):
    target = save_tiny_model(tmp_path_factory.mktemp("v4"), "deepseek_v4", vocab_size=V,
                             bos_token_id=0, eos_token_id=V - 1, pad_token_id=V - 1,
                             max_position_embeddings=64)
    add_mtp_weights(target)
    drafter = add_dspark_weights(target, tmp_path_factory.mktemp("dspark"))
    return target, drafter


def spec(method: str, drafter) -> dict:
    if method == "mtp":
        return dict(speculative_method="mtp", num_speculative_tokens=2)
    return dict(speculative_method="dspark", speculative_model=str(drafter),
                num_speculative_tokens=2, speculative_confidence_threshold=0.0)


@pytest.mark.slow  # thousands of sampled requests through a V4
@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_sampling_follows_the_target_distribution(v4_small, method):
    target, drafter = v4_small
    expected = marginals(target)
    params = [SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True, seed=i)
              for i in range(N)]
    with LLM(str(target), num_kv_blocks=2048, block_size=4, max_num_seqs=256,
             max_num_batched_tokens=2048, **spec(method, drafter)) as llm:
        outs = llm.generate([PROMPT] * N, params)
        stats = llm.stats()
    assert 0.05 < stats.spec_accepted_tokens / stats.spec_draft_tokens < 0.95  # both paths
    for position, probs in zip((1, 2), expected):
        counts = torch.bincount(torch.tensor([o.token_ids[position] for o in outs]),
                                minlength=V).float()
        assert chi_square_p(counts, probs) > 1e-3, (position, counts, probs * N)


@pytest.mark.slow  # (make test's budget)
@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_seeded_sampling_does_not_depend_on_the_batch(v4_small, method):
    target, drafter = v4_small
    mine = SamplingParams(max_tokens=16, temperature=0.8, ignore_eos=True, seed=11)
    others = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    prompts = [PROMPT, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [4, 4, 2]]
    engine = dict(num_kv_blocks=256, block_size=4, **spec(method, drafter))
    with LLM(str(target), **engine) as llm:
        alone = llm.generate([PROMPT], mine)[0].token_ids
        together = llm.generate(prompts, [mine, others, others])[0].token_ids
        stats = llm.stats()
    assert same_draws(together, alone)
    assert stats.spec_draft_tokens > 0
