"""Sampling with a draft model keeps the target's distribution, through the real processes.

A 16-token vocabulary makes the exact distributions computable: transformers gives the target's
probability of every continuation, and thousands of seeded requests (each its own seed, so the
test is deterministic) give the engine's. The draft model is a different random model, so many
drafts are rejected and the residual distribution is exercised. Chi-square at p < 1e-3: the
false-alarm rate a fresh set of seeds would have.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from tests.workers.sample.test_rejection import chi_square_p

V = 16
PROMPT = [3, 7, 1, 12, 5]
N = 3000


def small_vocab_model(out: Path, seed: int, scale: float, max_positions: int = 64) -> Path:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_positions,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=V - 1, pad_token_id=V - 1)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(scale)
    model.save_pretrained(str(out), safe_serialization=True)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"t{V - 1}"}))
    return out


def marginals(model_dir: Path) -> list[torch.Tensor]:
    """The target's exact distribution of the 2nd and 3rd generated tokens."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()

    def next_probs(prefixes: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(prefixes).logits[:, -1].float().softmax(-1)

    p0 = next_probs(torch.tensor([PROMPT]))[0]  # [V]
    grid = torch.arange(V)
    p1 = next_probs(torch.cat([torch.tensor(PROMPT).repeat(V, 1), grid[:, None]], 1))  # [V, V]
    pairs = torch.cartesian_prod(grid, grid)  # (t0, t1) rows
    p2 = next_probs(torch.cat([torch.tensor(PROMPT).repeat(V * V, 1), pairs], 1))
    joint01 = p0[:, None] * p1  # P(t0, t1)
    return [joint01.sum(0), (joint01.reshape(-1, 1) * p2).sum(0)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = small_vocab_model(tmp_path_factory.mktemp("target"), seed=0, scale=12.0)
    draft = small_vocab_model(tmp_path_factory.mktemp("draft"), seed=1, scale=12.0)
    return target, draft


def test_draft_model_sampling_follows_the_target_distribution(models):
    target, draft = models
    expected = marginals(target)
    params = [SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True, seed=i)
              for i in range(N)]
    with LLM(str(target), num_kv_blocks=2048, block_size=4, max_num_seqs=256,
             max_num_batched_tokens=2048, speculative_method="draft",
             speculative_model=str(draft), num_speculative_tokens=2) as llm:
        outs = llm.generate([PROMPT] * N, params)
        stats = llm.stats()
    assert 0.1 < stats.spec_accepted_tokens / stats.spec_draft_tokens < 0.9  # both paths used
    for position, probs in zip((1, 2), expected):
        counts = torch.bincount(torch.tensor([o.token_ids[position] for o in outs]),
                                minlength=V).float()
        assert chi_square_p(counts, probs) > 1e-3, (position, counts, probs * N)
