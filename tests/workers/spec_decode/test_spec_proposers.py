"""The proposer seam on a real ModelRunner: what a proposer is handed, and what it gets back."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.config import EngineConfig, ModelConfigError
from deepinfer.engine.protocol import (
    NewRequestInfo,
    SamplingParams,
    ScheduledSeq,
    StepPlan,
    pack_ids,
)
from deepinfer.workers.spec_decode.base import Draft, Proposer
from deepinfer.workers.spec_decode.factory import build_proposer


class HiddenStateProposer(Proposer):
    """Stands in for MTP / EAGLE heads: records the hidden states it is handed."""

    needs_hidden_states = True

    def __init__(self) -> None:
        self.seen: list[tuple[list[int], torch.Tensor | None]] = []
        self.verdicts: list[tuple[int, int]] = []

    def propose(self, step, requests):
        self.seen += [(r.known_tokens().tolist(), r.hidden) for r in requests]
        return [Draft([5] * r.max_drafts) for r in requests]

    def verified(self, request, proposed, accepted):
        self.verdicts.append((proposed, accepted))


def test_hidden_states_reach_the_proposer(tiny_model_dir):
    from deepinfer.workers.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=32,
                                      block_size=4))
    proposer = runner.spec.proposer = HiddenStateProposer()
    table = [pack_ids(range(8))]
    prompt = [11, 12, 13, 14, 15]
    params = SamplingParams(max_tokens=20, temperature=0.0)
    first = runner.execute(StepPlan(1, [ScheduledSeq("a", pack_ids(prompt), 0, table, True)],
                                    [NewRequestInfo("a", pack_ids(prompt), params)]))
    token = int.from_bytes(first.sampled_ids[:4], "little")
    result = runner.execute(StepPlan(2, [ScheduledSeq("a", pack_ids([token]), 5, table, True,
                                                      draft_slots=3)]))
    (tokens, hidden), = proposer.seen
    assert tokens == prompt + [token]
    # The hidden state handed over is the one whose logits produced the request's newest token.
    logits = runner.model.compute_logits(hidden[None])
    assert int(logits.argmax()) == token
    assert proposer.verdicts and proposer.verdicts[0][0] == 3
    assert result.num_drafts == pack_ids([3])


def test_mtp_needs_mtp_layers(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir), speculative_method="mtp")
    with pytest.raises(ModelConfigError, match="num_nextn_predict_layers > 0"):
        build_proposer(config, None)


def test_mtp_needs_the_checkpoints_mtp_weights(tmp_path):
    """HF drops MTP weights when it saves: such a checkpoint is refused in one line."""
    from scripts.tiny_models import save_tiny_model

    model = save_tiny_model(tmp_path / "ds", "deepseek_v3")
    config = EngineConfig(model=str(model), speculative_method="mtp")
    with pytest.raises(ModelConfigError, match=r"no usable MTP weights \(model\.layers\.3\."):
        build_proposer(config, None)


def test_a_draft_models_cache_takes_the_targets_kv_cache_dtype(tiny_model_dir):
    """With --kv-cache-dtype float16 the target's budget buys twice the blocks; the draft keeps
    as many, in float16 too (not twice the float32 memory)."""
    config = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=16, block_size=4,
                          speculative_method="draft", speculative_model=str(tiny_model_dir),
                          kv_cache_dtype="float16")
    proposer = build_proposer(config, None)
    assert {t.dtype for pair in proposer.kv for t in pair} == {torch.float16}
    assert proposer.kv[0][0].shape[0] == 16
