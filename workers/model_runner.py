"""Runs one StepPlan: builds the batch tensors, runs the model over the paged cache, samples."""

from __future__ import annotations

import time

import numpy as np
import torch

from engine.config import SLIDING, EngineConfig
from engine.protocol import StepPlan, StepResult, pack_ids, unpack_ids
from workers.attention import SeqSlice, select_backend
from workers.loader import DTYPES, load_model
from workers.sample.sampler import Sampler, SamplingState


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        dtype = DTYPES[config.dtype]
        # Chosen now, so the native kernel builds (or loads) at start, not in the first step.
        self.attention = select_backend("cpu", dtype)
        self.model = load_model(config.resolved_model_dir(), config.dtype,
                                config.cpu_linear_weights, self.attention)
        info = config.model_config()
        self.groups = info.kv_groups()
        self.windows = [info.sliding_window if g == SLIDING else None for g in self.groups]
        self.block_size = config.block_size
        self.num_blocks = config.kv_blocks()
        shape = (self.num_blocks, self.block_size, info.num_kv_heads, info.head_dim)
        # One (K, V) pair per layer; a slot is block * block_size + offset.
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in range(info.num_layers)
        ]
        # Host tier (prefix-cache blocks evicted from the device), full-attention layers only.
        host_blocks = config.host_kv_blocks()
        self.full_layers = [i for i in range(info.num_layers)
                            if self.groups[info.layer_group(i)] != SLIDING]
        host_shape = (host_blocks, self.block_size, info.num_kv_heads, info.head_dim)
        self.host_caches = {
            i: (torch.zeros(host_shape, dtype=dtype), torch.zeros(host_shape, dtype=dtype))
            for i in (self.full_layers if host_blocks else [])
        }
        self.sampler = Sampler(config.seed)
        self.states: dict[str, SamplingState] = {}

    def _copy_blocks(self, plan: StepPlan) -> None:
        """Host-tier copies, before the forward: swap-outs first, then swap-ins."""
        for packed, to_host in ((plan.swap_out, True), (plan.swap_in, False)):
            if not packed:
                continue
            pairs = torch.from_numpy(unpack_ids(packed).astype(np.int64)).view(-1, 2)
            for i in self.full_layers:
                for dev, host in zip(self.kv_caches[i], self.host_caches[i]):
                    src, dst = (dev, host) if to_host else (host, dev)
                    dst.index_copy_(0, pairs[:, 1], src.index_select(0, pairs[:, 0]))

    def _update_states(self, plan: StepPlan) -> None:
        self._copy_blocks(plan)
        for rid in plan.finished:
            self.states.pop(rid, None)
        for new in plan.new_requests:
            prompt = torch.from_numpy(unpack_ids(new.prompt_ids).copy())
            self.states[new.request_id] = SamplingState.create(new.params, prompt)

    def _forward(self, plan: StepPlan) -> tuple[torch.Tensor, list[int], list[SamplingState]]:
        """Hidden states of every token in the plan, plus the rows and states to sample."""
        ids, positions, sample_rows, sample_states = [], [], [], []
        slices: list[list[SeqSlice]] = [[] for _ in self.groups]
        row = 0
        for seq in plan.seqs:
            tokens = unpack_ids(seq.token_ids)
            if not len(tokens):  # overlap placeholder: our own last sample
                tokens = np.array([self.states[seq.request_id].output_ids[-1]], dtype=np.int32)
            n = len(tokens)
            ids.append(tokens)
            positions.append(np.arange(seq.start_pos, seq.start_pos + n, dtype=np.int64))
            for g, (kind, table) in enumerate(zip(self.groups, seq.block_tables)):
                sliding = kind == SLIDING
                slices[g].append(SeqSlice(
                    unpack_ids(table), seq.start_pos, n,
                    write_from=0 if sliding else seq.full_kv_from,
                    key_from=seq.window_from if sliding else 0,
                ))
            row += n
            if seq.sample:
                sample_rows.append(row - 1)
                sample_states.append(self.states[seq.request_id])
        input_ids = torch.from_numpy(np.concatenate(ids).astype(np.int64))
        pos = torch.from_numpy(np.concatenate(positions))
        metas = [self.attention.build_metadata(sl, self.block_size, w)
                 for sl, w in zip(slices, self.windows)]
        return self.model(input_ids, pos, self.kv_caches, metas), sample_rows, sample_states

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        self._update_states(plan)
        t0 = time.perf_counter()
        hidden, sample_rows, sample_states = self._forward(plan)
        if not sample_rows:
            return StepResult(plan.step_id, b"", forward_ms=(time.perf_counter() - t0) * 1e3)
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows)])
        t1 = time.perf_counter()
        tokens, logprobs = self.sampler(logits, sample_states)
        token_list = tokens.tolist()
        for state, tok in zip(sample_states, token_list):
            state.output_ids.append(tok)
        t2 = time.perf_counter()
        return StepResult(plan.step_id, pack_ids(token_list), logprobs,
                          forward_ms=(t1 - t0) * 1e3, sample_ms=(t2 - t1) * 1e3)

    @torch.inference_mode()
    def all_logits(self, plan: StepPlan) -> torch.Tensor:
        """Logits at every position of the plan (prompt logprobs; reference tests)."""
        self._update_states(plan)
        hidden, _, _ = self._forward(plan)
        return self.model.compute_logits(hidden)
