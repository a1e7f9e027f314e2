"""Prompts through the real scheduler and a ModelRunner in one process, step by step: every
logits row each request got (prompt positions in their chunks, then decode steps)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.protocol import (
    SamplingParams,
    StepResult,
    TokenizedRequest,
    pack_ids,
    unpack_ids,
)
from deepinfer.engine.scheduler.scheduler import Scheduler, SchedulerConfig


def run_engine(model_dir: Path, prompts: dict[str, list[int]], max_tokens: int = 1,
               **engine_args):
    """Greedy; 4-token blocks, 24-token steps, 10-token prefill chunks, so prompts split. Returns
    (runner, logits rows per request, sampled tokens per request, steps taken); checks every KV
    block came back."""
    from deepinfer.workers.model_runner import ModelRunner

    cfg = EngineConfig(model=str(model_dir), num_kv_blocks=64, block_size=4, **engine_args)
    runner = ModelRunner(cfg)
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_batched_tokens=24,
                                      prefill_chunk_size=10,
                                      kv_groups=cfg.model_config().kv_cache_layout().groups()))
    for rid, ids in prompts.items():
        sched.add(TokenizedRequest(rid, pack_ids(ids), SamplingParams(max_tokens=max_tokens)))
    logits, tokens = defaultdict(list), defaultdict(list)
    steps = 0
    while sched.has_work():
        step = sched.schedule()
        steps += 1
        out = runner.all_logits(step.plan)
        row, sampled = 0, []
        for _, seq in step.scheduled:
            n = len(unpack_ids(seq.token_ids))
            logits[seq.request_id].append(out[row: row + n])
            row += n
            if seq.sample:
                sampled.append(int(out[row - 1].argmax()))
                tokens[seq.request_id].append(sampled[-1])
        sched.update(step, StepResult(step.plan.step_id, pack_ids(sampled)))
    assert sched.kv.num_reusable() == sched.kv.num_total()
    return runner, {rid: torch.cat(rows) for rid, rows in logits.items()}, tokens, steps
