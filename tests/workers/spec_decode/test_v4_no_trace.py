"""Rejected drafts leave no trace in DeepSeek-V4's caches: after speculated steps, everything a
later query can read (each layer's window rows, the compressors' kv and gate rows and the
indexer's for the last W positions; every compressed entry and index key of a window that has
ended) equals what the same request computed without speculation, position by position.

A verification writes every draft's rows, and where a draft completes a CSA/HCA window that
window's entry; a random draft model is rejected almost always, so most verifications leave
rows of tokens that never happened, and entries of windows those tokens completed. Rows of the
positions past the request's computed length are not compared: no query reads them before the
verified token's own rows replace them (the V4 compressor recomputes a window in the step that
covers its last token).
"""

from __future__ import annotations

import numpy as np
import torch

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.kv_layout import SLIDING
from deepinfer.engine.protocol import SamplingParams, TokenizedRequest, pack_ids
from deepinfer.engine.scheduler.scheduler import Scheduler, SchedulerConfig
from scripts.tiny_models import save_tiny_model

BLOCKS, BS = 64, 4


def run_until(cfg: EngineConfig, prompt: list[int], computed: int):
    """Run one greedy request until its computed length reaches `computed` (or passes it):
    (the runner, the request, the scheduler)."""
    from deepinfer.workers.model_runner import ModelRunner

    runner = ModelRunner(cfg)
    sched = Scheduler(SchedulerConfig(
        num_blocks=BLOCKS, block_size=BS, max_num_batched_tokens=16, prefill_chunk_size=8,
        kv_groups=cfg.model_config().kv_cache_layout(BS).groups(),
        num_speculative_tokens=cfg.num_speculative_tokens if cfg.speculative_method else 0))
    sched.add(TokenizedRequest("r", pack_ids(prompt), SamplingParams(
        max_tokens=60, temperature=0.0, ignore_eos=True)))
    req = sched.requests["r"]
    while req.num_computed < computed:
        step = sched.schedule()
        sched.update(step, runner.execute(step.plan))
    return runner, req, sched


def readable(runner, req, cfg: EngineConfig, upto: int) -> dict[str, torch.Tensor]:
    """Every cache row a query at position `upto` or later may read, by entry."""
    layout = cfg.model_config().kv_cache_layout(BS)
    c = cfg.model_config().compressed
    out = {}
    for e, entry in enumerate(layout.layers):
        table = torch.tensor(req.tables[layout.group_of(e)], dtype=torch.int64)
        if entry.kind == SLIDING:
            pos = torch.arange(max(0, upto - entry.window), upto)
        else:  # one entry per window that has ended, over its window's last min(rate, BS) slots
            rate = c.csa_rate if c.attention[entry.layer] == "csa" else c.hca_rate
            per = min(rate, BS)
            count = upto // rate
            pos = ((torch.arange(count)[:, None] + 1) * rate - per + torch.arange(per)).flatten()
        cache = runner.kv_caches[e][0]
        rows = cache.view(-1, cache.shape[-1])[table[pos // BS] * BS + pos % BS]
        out[f"{entry.layer}.{entry.name}"] = rows
    return out


def test_rejected_drafts_leave_nothing_a_query_can_read(tmp_path):
    target = save_tiny_model(tmp_path / "v4", "deepseek_v4")
    draft = save_tiny_model(tmp_path / "draft", "llama", num_hidden_layers=2)
    prompt = np.random.default_rng(2).integers(3, 40000, 13).tolist()
    base = dict(model=str(target), num_kv_blocks=BLOCKS, block_size=BS)
    spec_cfg = EngineConfig(**base, speculative_method="draft", speculative_model=str(draft),
                            num_speculative_tokens=3)
    runner, req, sched = run_until(spec_cfg, prompt, 45)
    upto = req.num_computed
    # Verifications happened, and most of their drafts were rejected.
    assert sched.spec.verify_steps >= 5
    assert sched.spec.draft_tokens > sched.spec.accepted_tokens + 2 * sched.spec.verify_steps
    spec_rows = readable(runner, req, spec_cfg, upto)
    plain_cfg = EngineConfig(**base)
    runner, req, _ = run_until(plain_cfg, prompt, upto)
    assert req.num_computed == upto
    plain_rows = readable(runner, req, plain_cfg, upto)
    assert set(spec_rows) == set(plain_rows) and any("compressed" in k for k in spec_rows)
    for name, rows in plain_rows.items():
        diff = (spec_rows[name] - rows).abs().max().item()
        assert diff < 1e-4, (name, diff)
