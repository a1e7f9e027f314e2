"""One StepPlan as the flattened batch the model runs: tokens, positions, per-group slices.

Each seq contributes its input tokens (an overlap placeholder resolved to the request's own last
sample) followed, when it speculates, by the drafts its proposer made: those rows are verify
rows (each attends causally up to itself, on the decode path). The rows to compute logits for
are each sampled seq's last input row, or all of a verifying seq's rows (and, for prompt
logprobs, a prefill chunk's rows that predict prompt tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from deepinfer.engine.model_config import FULL, SLIDING
from deepinfer.engine.protocol import ScheduledSeq, StepPlan, unpack_ids
from deepinfer.workers.attention import SeqSlice
from deepinfer.workers.sample.prompt_logprobs import PromptTargets, chunk_targets
from deepinfer.workers.sample.sampler import SamplingState
from deepinfer.workers.spec_decode.base import Draft, StepInput


@dataclass
class SeqRows:
    seq: ScheduledSeq
    state: SamplingState
    tokens: np.ndarray  # the real input tokens (placeholder resolved)
    first_row: int  # of its input tokens in the batch
    draft: Draft | None = None  # the drafts appended after its input, when it speculates
    logit_row: int = 0  # where its first verified (or its only) row sits in the step's logits

    @property
    def num_rows(self) -> int:
        return len(self.tokens) + (len(self.draft.tokens) if self.draft else 0)

    @property
    def verify_row(self) -> int:
        """Row of its last input token: the first of the rows a verification reads."""
        return self.first_row + len(self.tokens) - 1


@dataclass
class StepBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slices: list[list[SeqSlice]]  # per KV group
    rows: list[SeqRows] = field(default_factory=list)


def resolve_inputs(plan: StepPlan, states: dict[str, SamplingState], groups: list[str]
                   ) -> list[StepInput]:
    """Every seq's real input tokens; an empty token list is the overlap placeholder: the token
    this worker sampled for the request in the previous step."""
    full = groups.index(FULL) if FULL in groups else None
    inputs = []
    for seq in plan.seqs:
        tokens = unpack_ids(seq.token_ids)
        if not len(tokens):
            tokens = np.array([states[seq.request_id].output_ids[-1]], dtype=np.int32)
        table = unpack_ids(seq.block_tables[full]) if full is not None else None
        inputs.append(StepInput(seq.request_id, tokens, seq.start_pos, table, seq.full_kv_from))
    return inputs


def build_batch(plan: StepPlan, inputs: list[StepInput], states: dict[str, SamplingState],
                groups: list[str], drafts: dict[int, Draft]) -> StepBatch:
    """The batch for `plan`; `drafts[i]` are appended after seq i's input token."""
    ids, positions = [], []
    slices: list[list[SeqSlice]] = [[] for _ in groups]
    rows: list[SeqRows] = []
    row = 0
    for i, (seq, inp) in enumerate(zip(plan.seqs, inputs)):
        draft = drafts.get(i)
        tokens = inp.tokens
        if draft is not None and draft.tokens:
            tokens = np.concatenate([tokens, np.asarray(draft.tokens, dtype=np.int32)])
        n = len(tokens)
        ids.append(tokens)
        positions.append(np.arange(seq.start_pos, seq.start_pos + n, dtype=np.int64))
        for g, (kind, table) in enumerate(zip(groups, seq.block_tables)):
            sliding = kind == SLIDING
            slices[g].append(SeqSlice(
                unpack_ids(table), seq.start_pos, n,
                write_from=0 if sliding else seq.full_kv_from,
                key_from=seq.window_from if sliding else 0,
                verify=draft is not None,
            ))
        rows.append(SeqRows(seq, states[seq.request_id], inp.tokens, row, draft))
        row += n
    input_ids = torch.from_numpy(np.concatenate(ids).astype(np.int64))
    return StepBatch(input_ids, torch.from_numpy(np.concatenate(positions)), slices, rows)


def logit_rows(sampled: list[SeqRows]) -> list[int]:
    """The batch rows to compute logits at, only where a token is drawn: a seq's last input
    row, or every row a draft is verified at. Sets each seq's `logit_row` in them."""
    index: list[int] = []
    for r in sampled:
        r.logit_row = len(index)
        index += range(r.verify_row, r.verify_row + 1 + (len(r.draft.tokens) if r.draft else 0))
    return index


def prompt_targets(rows: list[SeqRows]) -> list[PromptTargets]:
    """What each seq whose plan asks for prompt logprobs predicts, in batch order."""
    return [chunk_targets(r.state.prompt_ids, r.seq.start_pos, len(r.tokens), r.first_row,
                          r.state.params.prompt_logprobs or 0)
            for r in rows if r.seq.prompt_logprobs]
