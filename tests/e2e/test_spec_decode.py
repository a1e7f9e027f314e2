"""Speculative decoding through the real processes: exactness, acceptance, no leaks.

Greedy text must be identical with and without speculation (n-gram and draft model); a draft
model equal to the target must be accepted every time (also with prefix-cache hits, where a draft
model that lost its KV for cached blocks would start to disagree: the acceptance decay vLLM
users reported).
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from deepinfer import LLM, SamplingParams
from scripts.tiny_models import add_mtp_weights, save_tiny_model

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10] * 3, [100, 200, 300, 400], list(range(1000, 1030))]


# The Qwen3 pair (qk-norm) repeats every identity on a second family: `make test-slow`.
@pytest.fixture(scope="module", params=["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def pair(request, tmp_path_factory):
    """A tiny target and a different tiny draft with the same tokenizer."""
    arch = request.param
    kw = dict(num_key_value_heads=2) if arch == "qwen3" else {}
    target = save_tiny_model(tmp_path_factory.mktemp(f"{arch}-target"), arch, **kw)
    draft = save_tiny_model(tmp_path_factory.mktemp(f"{arch}-draft"), arch, seed=1,
                            num_hidden_layers=2, **kw)
    return target, draft


def generate(model, prompts, params, **engine):
    with LLM(str(model), num_kv_blocks=256, block_size=4, **engine) as llm:
        outs = llm.generate(prompts, params)
        return outs, llm.stats()


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_text_is_identical_with_speculation(pair, method):
    target, draft = pair
    ref, _ = generate(target, PROMPTS, GREEDY)
    spec = dict(speculative_method=method, num_speculative_tokens=3)
    if method == "draft":
        spec["speculative_model"] = str(draft)
    outs, stats = generate(target, PROMPTS, GREEDY, **spec)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert stats.spec_draft_tokens > 0
    if method == "ngram":  # random tiny models repeat themselves: lookups hit
        assert stats.spec_accepted_tokens > 0


def test_a_draft_equal_to_the_target_is_always_accepted(pair):
    target, _ = pair
    sampled = SamplingParams(max_tokens=30, temperature=0.9, top_k=50, ignore_eos=True, seed=7,
                             logprobs=0)
    for params in (GREEDY, sampled):
        outs, stats = generate(target, PROMPTS, params, speculative_method="draft",
                               speculative_model=str(target), num_speculative_tokens=4)
        assert stats.spec_draft_tokens > 0
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens
        assert all(len(o.token_ids) == len(o.logprobs) or params is GREEDY for o in outs)


@pytest.mark.parametrize("host_tier", [False, True])
def test_acceptance_does_not_decay_with_prefix_cache_hits(pair, host_tier):
    """Requests sharing a long prefix: later ones reuse its cached blocks, where the draft
    model's KV must be as good as if it had computed them itself."""
    target, _ = pair
    rng = np.random.default_rng(3)
    prefixes = [rng.integers(3, 40000, 48).tolist() for _ in range(2)]
    # With the host tier, 30 blocks hold one 90-token request: each prefix evicts the other's
    # blocks to the host tier and the next request with that prefix brings them back.
    extra = dict(host_kv_cache_gb=0.001) if host_tier else {}
    with LLM(str(target), num_kv_blocks=30 if host_tier else 256, block_size=4,
             speculative_method="draft", speculative_model=str(target),
             num_speculative_tokens=3, **extra) as llm:
        rates = []
        for i in range(6):
            before = llm.stats()
            out = llm.generate([prefixes[i % 2] + [500 + i]], GREEDY)[0]
            after = llm.stats()
            drafts = after.spec_draft_tokens - before.spec_draft_tokens
            rates.append((after.spec_accepted_tokens - before.spec_accepted_tokens) / drafts)
            if i >= 2:
                assert out.cached_tokens >= 40
        stats = llm.stats()
    assert rates == [1.0] * 6, rates
    if host_tier:
        assert stats.host_blocks_in > 0


def test_preemption_mid_speculation_leaks_nothing_and_changes_nothing(pair):
    target, draft = pair
    prompts = [np.random.default_rng(i).integers(3, 40000, 20).tolist() for i in range(6)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    with LLM(str(target), num_kv_blocks=256, block_size=4) as llm:
        ref = [o.token_ids for o in llm.generate(prompts, params)]
    # 40 blocks of 4 cannot hold six 50-token sequences: requests are preempted mid-run.
    with LLM(str(target), num_kv_blocks=40, block_size=4, speculative_method="draft",
             speculative_model=str(draft), num_speculative_tokens=3) as llm:
        outs = [o.token_ids for o in llm.generate(prompts, params)]
        stats = llm.stats()
    assert outs == ref
    assert stats.num_preemptions > 0 and stats.spec_draft_tokens > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total


@pytest.mark.slow  # the real model's acceptance; the tiny pairs above hold the identities
def test_default_model_copying_its_prompt(default_model):
    """The workload n-gram speculation is for: greedy text unchanged, most drafts accepted."""
    code = "\n".join(f"    total_{i} = values[{i}] * weight + offset" for i in range(12))
    msgs = [{"role": "user", "content": "Repeat this code exactly:\n\ndef f(values):\n" + code}]
    params = SamplingParams(max_tokens=120, temperature=0.0)
    with LLM("default") as llm:
        ref = llm.chat(msgs, params)
    with LLM("default", speculative_method="ngram", num_speculative_tokens=3) as llm:
        out = llm.chat(msgs, params)
        stats = llm.stats()
    assert out.token_ids == ref.token_ids
    assert stats.spec_accepted_tokens > max(20, 0.3 * stats.spec_draft_tokens)
    # The default model as its own draft model: the same text, every draft accepted.
    with LLM("default", speculative_method="draft", speculative_model="default") as llm:
        out = llm.chat(msgs, params)
        stats = llm.stats()
    assert out.token_ids == ref.token_ids
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 50


def test_mixed_batches_prefill_chunks_and_opted_out_requests(pair):
    """Verifications share steps with other requests' prefill chunks (a long prompt in
    16-token chunks) and with requests that opted out; greedy text is unchanged for all."""
    target, draft = pair
    prompts = PROMPTS + [np.random.default_rng(9).integers(3, 40000, 300).tolist()]
    params = [GREEDY, msgspec.structs.replace(GREEDY, speculative=False), GREEDY, GREEDY]
    ref, _ = generate(target, prompts, params, prefill_chunk_size=16)
    for method in ("ngram", "draft"):
        spec = dict(speculative_method=method, speculative_model=str(draft)
                    if method == "draft" else None)
        outs, stats = generate(target, prompts, params, prefill_chunk_size=16, **spec)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref], method
        assert stats.spec_draft_tokens > 0


def test_seeded_sampling_does_not_depend_on_the_batch(pair):
    target, draft = pair
    mine = SamplingParams(max_tokens=30, temperature=0.8, ignore_eos=True, seed=11)
    others = SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)
    spec = dict(speculative_method="draft", speculative_model=str(draft))
    alone, _ = generate(target, PROMPTS[:1], mine, **spec)
    together, stats = generate(target, PROMPTS, [mine, others, others], **spec)
    assert same_draws(together[0].token_ids, alone[0].token_ids)
    assert stats.spec_draft_tokens > 0


def same_draws(a: list[int], b: list[int]) -> bool:
    """Equal, or equal up to a floating-point tie: a batch of 12 verify rows and one of 4 take
    different GEMM kernels, whose logits may differ in the last bits, and a uniform within that
    of a CDF boundary picks the next token in vocabulary order (the full vocabulary here: no
    top-k or top-p); from there the contexts differ. A draw keyed on the batch would differ at
    once, and not by one id."""
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is None:
        return a == b
    return first > 0 and abs(a[first] - b[first]) == 1


def test_mtp_greedy_text_is_identical_under_chunking_and_preemption(tmp_path):
    """DeepSeek-V3's MTP layer as the proposer (its drafts are checked against a reference MTP
    layer in tests/workers/spec_decode/test_mtp.py); 40 blocks of 4 tokens cannot hold all six
    requests."""
    model = save_tiny_model(tmp_path / "ds", "deepseek_v3")
    add_mtp_weights(model)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 40000, size=n).tolist() for n in (3, 29, 12, 41, 7, 20)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = dict(num_kv_blocks=40, block_size=4, prefill_chunk_size=8,
                  max_num_batched_tokens=16)
    with LLM(str(model), **engine) as llm:
        ref = llm.generate(prompts, params)
    with LLM(str(model), speculative_method="mtp", num_speculative_tokens=2, **engine) as llm:
        outs = llm.generate(prompts, params)
        stats = llm.stats()
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert stats.spec_draft_tokens > 0 and stats.num_preemptions > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_float16_kv_cache_draft_equal_to_target_is_always_accepted(pair):
    """--kv-cache-dtype float16 for the target and its draft: the same model over the same
    rounded K/V proposes exactly what the target verifies; the text is that of the same engine
    without speculation."""
    target, _ = pair
    ref, _ = generate(target, PROMPTS, GREEDY, kv_cache_dtype="float16")
    outs, stats = generate(target, PROMPTS, GREEDY, kv_cache_dtype="float16",
                           speculative_method="draft", speculative_model=str(target),
                           num_speculative_tokens=4)
    assert stats.spec_draft_tokens > 0
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def test_a_draft_equal_to_the_target_is_always_accepted_across_plain_steps(pair):
    """A request that speculates, then decodes plainly, then speculates again: the plain steps
    must leave the draft model's K/V whole (a fully accepted run's last draft, which it never
    read, included). Two sequence slots and no speculation beside another request: the long
    request speculates alone for one step each time a short one finishes (the next one is
    admitted in that step), then decodes plainly beside it."""
    target, _ = pair
    rng = np.random.default_rng(6)
    prompts = [rng.integers(3, 40000, 6).tolist() for _ in range(8)]
    params = [msgspec.structs.replace(GREEDY, max_tokens=5 if i != 1 else 60)
              for i in range(8)]
    outs, stats = generate(target, prompts, params, max_num_seqs=2,
                           speculative_disable_by_batch_size=1, speculative_method="draft",
                           speculative_model=str(target), num_speculative_tokens=3)
    assert stats.spec_verify_steps >= 5 and stats.spec_draft_tokens > 0
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    """A 16-token target whose sampled text repeats itself (n-gram lookups hit) and a
    different draft model of the same vocabulary."""
    from tests.e2e.test_spec_distribution import small_vocab_model

    return [small_vocab_model(tmp_path_factory.mktemp(name), seed, 12.0, max_positions=512)
            for name, seed in (("target", 0), ("draft", 1))]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_seeded_sampled_text_does_not_depend_on_draft_slots(peaked, method):
    """A seeded request's text depends on its seed only: with speculation alone, beside a long
    prompt prefilled in 16-token chunks first (which leaves its decodes one draft slot instead
    of three), and without speculation: one uniform per output index, whatever the number of
    drafts verified."""
    target, draft = peaked
    prompt = [3, 7, 1, 12, 5] * 2
    long_prompt = np.random.default_rng(1).integers(0, 15, 200).tolist()
    mine = SamplingParams(max_tokens=40, temperature=0.6, seed=7, ignore_eos=True)
    other = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine = dict(num_kv_blocks=512, block_size=4, prefill_chunk_size=16,
                  max_num_batched_tokens=18)
    spec = dict(speculative_method=method, num_speculative_tokens=3, ngram_min=1, ngram_max=3,
                speculative_model=str(draft) if method == "draft" else None)
    with LLM(str(target), **engine) as llm:
        ref = llm.generate([prompt], mine)[0].token_ids
    with LLM(str(target), **engine, **spec) as llm:
        alone = llm.generate([prompt], mine)[0].token_ids
        stats = llm.stats()
        together = llm.generate([long_prompt, prompt], [other, mine])[1].token_ids
    assert stats.spec_accepted_tokens > 0 and stats.spec_draft_tokens > stats.spec_accepted_tokens
    assert (alone, together) == (ref, ref)
