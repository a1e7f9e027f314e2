"""Prompt logprobs of a step's prefill chunks against log_softmax of the whole prompt's logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.engine.protocol import SamplingParams, ScheduledSeq, pack_ids
from deepinfer.workers.sample import prompt_logprobs as module
from deepinfer.workers.sample.prompt_logprobs import prompt_logprobs
from deepinfer.workers.sample.sampler import SamplingState
from deepinfer.workers.step_batch import SeqRows, prompt_targets

VOCAB = 50


def rows_for(prompt: list[int], chunks: list[tuple[int, int]], k: int | None,
             first_row: int = 0):
    """What the runner asks for one chunk (start, n) of `prompt` each, laid out back to back
    from `first_row` (step_batch.prompt_targets of their SeqRows)."""
    state = SamplingState.create(SamplingParams(prompt_logprobs=k), torch.tensor(prompt))
    rows, row = [], first_row
    for start, n in chunks:
        seq = ScheduledSeq("r", pack_ids(prompt[start:start + n]), start, [],
                           start + n == len(prompt), prompt_logprobs=k is not None)
        rows.append(SeqRows(seq, state, np.asarray(prompt[start:start + n], np.int32), row))
        row += n
    return prompt_targets(rows)


def unpacked(piece, k: int):
    n = piece.count
    return (piece.start, np.frombuffer(piece.logprobs, np.float32),
            np.frombuffer(piece.ranks, np.int32),
            np.frombuffer(piece.top_ids, np.int32).reshape(n, k),
            np.frombuffer(piece.top_logprobs, np.float32).reshape(n, k))


@pytest.mark.parametrize("slice_rows", [128, 3])
def test_chunks_match_the_whole_prompts_log_softmax(monkeypatch, slice_rows):
    monkeypatch.setattr(module, "ROWS_PER_SLICE", slice_rows)
    torch.manual_seed(0)
    prompt = torch.randint(0, VOCAB, (13,)).tolist()
    logits = torch.randn(len(prompt), VOCAB) * 3  # the logits at each prompt position
    k = 4
    # Three chunks; the hidden states here are the logits themselves.
    chunks = [(0, 5), (5, 6), (11, 2)]
    calls = []

    def compute_logits(h: torch.Tensor) -> torch.Tensor:
        calls.append(len(h))
        return h

    pieces = prompt_logprobs(compute_logits, logits, rows_for(prompt, chunks, k), True)
    assert max(calls) <= slice_rows
    ref = logits.log_softmax(-1)
    starts = []
    for piece in pieces:
        start, lps, ranks, top_ids, top_vals = unpacked(piece, k)
        starts.append((start, piece.count))
        for j in range(piece.count):
            pos = start + j  # the prompt token these logits (at pos - 1) predict
            row = ref[pos - 1]
            assert lps[j] == pytest.approx(float(row[prompt[pos]]), abs=1e-5)
            assert ranks[j] == int((row >= row[prompt[pos]]).sum())
            assert top_ids[j].tolist() == row.topk(k).indices.tolist()
            np.testing.assert_allclose(top_vals[j], row.topk(k).values.numpy(), atol=1e-5)
    # Positions 1..12: the last prompt position's logits are the sample's, not a prompt's.
    assert starts == [(1, 5), (6, 6), (12, 1)]


def test_k_zero_an_empty_chunk_and_other_ranks():
    prompt = [3, 1, 4, 1, 5]
    logits = torch.randn(len(prompt), VOCAB)
    # The last chunk (position 4 alone) predicts no prompt token: an empty piece keeps order.
    rows = rows_for(prompt, [(0, 4), (4, 1)], 0)
    pieces = prompt_logprobs(lambda h: h, logits, rows, True)
    assert [(p.start, p.count) for p in pieces] == [(1, 4), (5, 0)]
    assert pieces[0].top_ids == b"" and len(pieces[0].ranks) == 16
    # A rank that does not answer computes the logits (the LM head's collective) but no piece.
    calls = []
    assert prompt_logprobs(lambda h: calls.append(len(h)) or h, logits, rows, False) == []
    assert calls == [4]


def test_seqs_that_did_not_ask_are_skipped():
    prompt = [3, 1, 4, 1, 5]
    rows = rows_for(prompt, [(0, 5)], None)
    assert prompt_logprobs(lambda h: pytest.fail("no logits"), torch.zeros(5, VOCAB), rows,
                           True) == []
