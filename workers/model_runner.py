"""Runs one StepPlan: builds the batch, runs the model over the paged cache, samples.

With speculative decoding, the proposer drafts tokens for the seqs the scheduler gave draft
slots, the drafts ride in the same forward as everything else, and the rejection sampler keeps
a prefix of them plus one token of the target's (workers/sample/rejection.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.kv_layout import KV, LayerKVLayout
from deepinfer.engine.protocol import (
    CompileGrammar,
    SampledLogprobs,
    StepPlan,
    StepResult,
    pack_ids,
    unpack_ids,
)
from deepinfer.workers.attention import AttentionMetadata, select_backend
from deepinfer.workers.attention.triton_backend import TritonAttention
from deepinfer.workers.cuda_graphs import DecodeGraphs, capture_sizes
from deepinfer.workers.distributed.parallel_state import group, tp
from deepinfer.workers.kv_connectors import WorkerConnector, build_worker_connectors
from deepinfer.workers.loader import DTYPES, load_model
from deepinfer.workers.sample.rejection import Verification, verify
from deepinfer.workers.sample.sampler import Sampler, SamplingState
from deepinfer.workers.spec_decode.base import Draft, DraftRequest, ObservedSeq, Proposer, StepInput
from deepinfer.workers.spec_decode.factory import build_proposer
from deepinfer.workers.step_batch import SeqRows, StepBatch, build_batch, resolve_inputs
from deepinfer.workers.structured.compile_service import GrammarCompileService
from deepinfer.workers.structured.masks import MaskedRows, accept, allowed_drafts, fill_bitmask

log = logging.getLogger("deepinfer.worker")


def rows_of(t: torch.Tensor, index: list[int]) -> torch.Tensor:
    """t's rows at `index`: a view when they are consecutive (a batch's logit rows usually
    are), else one index_select (advanced indexing costs ~3x more on CPU: ~45 us a step)."""
    if index and index == list(range(index[0], index[0] + len(index))):
        return t.narrow(0, index[0], len(index))
    return t.index_select(0, torch.tensor(index, dtype=torch.int64, device=t.device))


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device | None = None,
                 transport=None) -> None:
        """`device`: where the model, the KV cache and the forward live (workers/device.py;
        default the CPU). Sampling stays on the host: a GPU's logits come over once a step.
        `transport`: (zmq context, rank, where reports go) for connectors that talk to other
        servers (a worker process has them)."""
        self.config = config
        self.device = device = device or torch.device("cpu")
        dtype = DTYPES[config.dtype]
        # Chosen now, so the native kernel builds (or loads) at start, not in the first step.
        self.attention = select_backend(device, dtype)
        self.model = load_model(config.resolved_model_dir(), config.dtype,
                                config.cpu_linear_weights, self.attention,
                                quantization=config.quantization, device=device)
        layout = config.kv_cache_layout()
        self.groups = [g.kind for g in layout.groups()]
        self.windows = [g.window for g in layout.groups()]
        self.block_size = config.block_size
        self.num_blocks = config.kv_blocks()
        # One (K, V) pair per layer, shaped by its layout; a slot is block * block_size + offset.
        self.tp = tp()  # tensor parallelism: this rank holds its share of the KV heads
        self.group = group()  # rank 0 samples for every rank
        kv_dtype = DTYPES[config.kv_dtype()]  # --kv-cache-dtype (auto: the model's)
        self.kv_caches = [self._kv_pair(self.num_blocks, layer, kv_dtype)
                          for layer in layout.layers]
        self.graphs = self._decode_graphs()
        self.sampler = Sampler(config.seed)
        self.states: dict[str, SamplingState] = {}
        self.proposer: Proposer | None = build_proposer(config, self.sampler)
        self.last_hidden: dict[str, torch.Tensor] = {}  # for proposers that read it
        self._grammars: GrammarCompileService | None = None  # with the first structured request
        # The KV connectors' worker halves (workers/kv_connectors): the host tier copies a
        # proposer's own cache beside the target's.
        others = [self.proposer.copy_blocks] if self.proposer is not None else []
        self.connectors: list[WorkerConnector] = build_worker_connectors(
            config, self.kv_caches, others, transport)

    def _decode_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs of decode-only steps, where the forward can be one (workers/cuda_graphs.py);
        a capture that fails leaves the runner eager, with a warning."""
        if (self.device.type != "cuda" or self.config.enforce_eager
                or not isinstance(self.attention, TritonAttention)
                or not DecodeGraphs.supported(self.model, self.tp.world)):
            return None
        max_blocks = -(-self.config.context_len() // self.block_size)
        try:
            graphs = DecodeGraphs(self.model, self.kv_caches,
                                  capture_sizes(self.config.max_num_seqs), max_blocks,
                                  self.windows, self.block_size, self.device)
        except Exception as e:  # noqa: BLE001 (any capture failure: run eagerly)
            log.warning("CUDA graphs off, the capture failed: %s: %s", type(e).__name__, e)
            return None
        log.info("CUDA graphs captured for decode batches of %s rows",
                 [b.size for b in graphs.buffers])
        return graphs

    @property
    def grammars(self) -> GrammarCompileService:
        if self._grammars is None:
            config, info = self.config, self.config.model_config()

            def backend():  # xgrammar (and transformers) load in the compile thread
                from deepinfer.workers.structured.xgrammar_backend import XGrammarBackend

                return XGrammarBackend.for_model(config.resolved_model_dir(), info.vocab_size,
                                                 list(info.eos_token_ids))

            self._grammars = GrammarCompileService(backend, config.grammar_compile_timeout)
        return self._grammars

    def compile_grammar(self, msg: CompileGrammar,
                        on_ready: Callable[[str, str | None], None]) -> None:
        """Start compiling a request's grammar off the step loop; `on_ready` follows."""
        self.grammars.submit(msg.request_id, msg.grammar, on_ready)

    def _kv_pair(self, blocks: int, layer: LayerKVLayout, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's cache on the device (this rank's share of the KV heads)."""
        k, v = layer.entry_shapes()
        if layer.entry == KV and self.tp.world > 1:
            heads = self.tp.kv_heads(layer.num_kv_heads)[1]
            k, v = (heads, k[1]), (heads, v[1])
        return (torch.zeros((blocks, self.block_size, *k), dtype=dtype, device=self.device),
                torch.zeros((blocks, self.block_size, *v), dtype=dtype, device=self.device))

    def _update_states(self, plan: StepPlan) -> None:
        for connector in self.connectors:
            entry = plan.connectors.get(connector.name)
            if entry is not None:
                connector.before_forward(entry)
        for rid in plan.finished:
            self.states.pop(rid, None)
            self.last_hidden.pop(rid, None)
            if self._grammars is not None:
                self._grammars.forget(rid)
        if self.proposer is not None and plan.finished:
            self.proposer.forget(plan.finished)
        for new in plan.new_requests:
            prompt = torch.from_numpy(unpack_ids(new.prompt_ids).copy())
            state = SamplingState.create(new.params, prompt)
            if new.params.grammar is not None:
                grammars = self.grammars
                state.grammar = grammars.backend.matcher(
                    grammars.take(new.request_id, new.params.grammar))
            if new.output_ids:  # a decode after a remote prefill: its first token is known
                first = unpack_ids(new.output_ids).tolist()
                state.output_ids.extend(first)
                if state.grammar is not None:
                    accept(state.grammar, first)
            self.states[new.request_id] = state

    def _propose(self, plan: StepPlan, inputs: list[StepInput]
                 ) -> tuple[dict[int, Draft], dict[int, DraftRequest]]:
        """Drafts for the seqs the scheduler gave draft slots (possibly none found)."""
        requests = {i: DraftRequest(seq.request_id, self.states[seq.request_id], seq.start_pos,
                                    seq.draft_slots, self.last_hidden.get(seq.request_id))
                    for i, seq in enumerate(plan.seqs) if seq.draft_slots and seq.sample}
        if self.proposer is None:
            return {i: Draft([]) for i in requests}, requests
        drafts = self.proposer.propose(inputs, list(requests.values()))
        out = {}
        for (i, req), draft in zip(requests.items(), drafts):
            keep = draft.tokens[: req.max_drafts]
            if req.state.grammar is not None:
                keep = allowed_drafts(req.state.grammar, keep, draft.probs is not None)
            probs = draft.probs[: len(keep)] if draft.probs is not None else None
            out[i] = Draft(keep, probs)
        return out, requests

    def _run(self, batch: StepBatch) -> torch.Tensor:
        dev = self.device  # (a no-op on the CPU)
        ids = batch.input_ids.to(dev, non_blocking=True)
        positions = batch.positions.to(dev, non_blocking=True)
        if self.graphs is None:
            metas = [self.attention.build_metadata(sl, self.block_size, w)
                     for sl, w in zip(batch.slices, self.windows)]
            return self.model(ids, positions, self.kv_caches, metas)
        # The graphs copy host metadata into their own buffers; only a step they do not take
        # moves it to the device the backend's way.
        base = [AttentionMetadata.build(sl, self.block_size, w)
                for sl, w in zip(batch.slices, self.windows)]
        hidden = self.graphs.run(ids, positions, base)
        if hidden is not None:
            return hidden
        metas = [self.attention.on_device(m) for m in base]
        return self.model(ids, positions, self.kv_caches, metas)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        self._update_states(plan)
        if not plan.seqs:  # only KV-transfer work in this plan
            return StepResult(plan.step_id, b"")
        t0 = time.perf_counter()
        inputs = resolve_inputs(plan, self.states, self.groups)
        drafts, requests = self._propose(plan, inputs)
        batch = build_batch(plan, inputs, self.states, self.groups, drafts)
        hidden = self._run(batch)
        sampled = [r for r in batch.rows if r.seq.sample]
        if not sampled:
            self._observe(batch, hidden, inputs)
            return StepResult(plan.step_id, b"", forward_ms=(time.perf_counter() - t0) * 1e3)
        # Logits only where a token is drawn: a seq's last row, or every row a draft is
        # verified at.
        index = []
        for r in sampled:
            first = len(index)
            index += range(r.verify_row, r.verify_row + 1 + (len(r.draft.tokens) if r.draft
                                                               else 0))
            r.logit_row = first
        logits = self.model.compute_logits(rows_of(hidden, index)).cpu()  # host sampling
        t1 = time.perf_counter()
        if self.group.rank == 0:  # samples; the other ranks take its tokens
            self._constrain(logits, sampled)
            new = self._sample(logits, sampled)
        else:
            new = []
        new = self._share_sampled(new, len(sampled))
        t2 = time.perf_counter()
        self._record(sampled, new, requests, hidden, index)
        self._observe(batch, hidden, inputs)
        return self._result(plan, sampled, new, (t1 - t0) * 1e3, (t2 - t1) * 1e3)

    def _share_sampled(self, new: list, count: int) -> list:
        """Tensor parallelism: rank 0's new tokens per sampled seq, on every rank (their
        request states, overlap placeholders and grammar matchers follow it)."""
        if self.group.world == 1:
            return new
        dev = self.device  # NCCL moves device tensors only
        if self.group.rank == 0:
            data = torch.tensor([len(t) for t, _ in new] + [x for t, _ in new for x in t],
                                dtype=torch.int64, device=dev)
            size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=dev)
        self.group.broadcast(size)
        if self.group.rank == 0:
            self.group.broadcast(data)
            return new
        data = self.group.broadcast(torch.empty(int(size), dtype=torch.int64,
                                                device=dev)).tolist()
        out, pos = [], count
        for n in data[:count]:
            out.append((data[pos: pos + n], [None] * n))
            pos += n
        return out

    def _constrain(self, logits: torch.Tensor, sampled: list[SeqRows]) -> None:
        """Structured output: tokens the grammar forbids get -inf, on the rows of constrained
        requests only (their logprobs are then the constrained distribution's)."""
        rows = [MaskedRows(r.state.grammar, r.draft.tokens if r.draft else [], r.logit_row)
                for r in sampled if r.state.grammar is not None]
        if not rows:
            return
        backend = self.grammars.backend
        bitmask, masked = fill_bitmask(backend, rows, logits.shape[0])
        if masked:
            backend.apply(logits, bitmask, masked)

    def _sample(self, logits: torch.Tensor, sampled: list[SeqRows]
                ) -> list[tuple[list[int], list[SampledLogprobs | None]]]:
        """New tokens and their logprobs per sampled seq: plain rows in one batched draw,
        verifying seqs through the rejection sampler."""
        out: list = [None] * len(sampled)
        plain = [i for i, r in enumerate(sampled) if r.draft is None]
        if plain:
            rows = rows_of(logits, [sampled[i].logit_row for i in plain])
            tokens, logprobs = self.sampler(rows, [sampled[i].state for i in plain])
            for j, (i, token) in enumerate(zip(plain, tokens.tolist())):
                out[i] = ([token], [logprobs[j]] if logprobs else [None])
        checks = [i for i, r in enumerate(sampled) if r.draft is not None]
        if checks:
            verified = verify(self.sampler, logits, [
                Verification(sampled[i].state, sampled[i].draft.tokens, sampled[i].draft.probs,
                             sampled[i].logit_row) for i in checks])
            for i, (tokens, logprobs) in zip(checks, verified):
                out[i] = (tokens, logprobs or [None] * len(tokens))
        return out

    def _record(self, sampled: list[SeqRows], new, requests: dict[int, DraftRequest],
                hidden: torch.Tensor, index: list[int]) -> None:
        """The requests' own histories, what the proposer needs to know, hidden states."""
        keep_hidden = self.proposer is not None and self.proposer.needs_hidden_states
        by_id = {req.request_id: req for req in requests.values()}
        for r, (tokens, _) in zip(sampled, new):
            r.state.output_ids.extend(tokens)
            if r.state.grammar is not None:
                accept(r.state.grammar, tokens)
            req = by_id.get(r.seq.request_id)
            if req is not None and self.proposer is not None:
                self.proposer.verified(req, len(r.draft.tokens), len(tokens) - 1)
            if keep_hidden:  # the row whose logits produced the newest token
                self.last_hidden[r.seq.request_id] = hidden[index[r.logit_row + len(tokens) - 1]]

    def _observe(self, batch: StepBatch, hidden: torch.Tensor, inputs: list[StepInput]) -> None:
        """Tell a proposer that follows the target's hidden states what each seq computed:
        its input rows and the drafts it kept (after `_record`: the outputs are known)."""
        if self.proposer is None or not self.proposer.observes:
            return
        seqs = []
        for r, inp in zip(batch.rows, inputs):
            state, start = r.state, r.seq.start_pos
            known = len(state.prompt_ids) + len(state.output_ids)
            kept = 0
            if r.draft:  # the verified tokens after the input: kept drafts, then one more
                kept = known - (start + len(r.tokens)) - 1
            tokens = np.concatenate([r.tokens, np.asarray(r.draft.tokens[:kept], np.int32)]
                                    ) if kept else r.tokens
            end = start + len(tokens)
            nxt = None
            if end < known:
                nxt = int(state.prompt_ids[end]) if end < len(state.prompt_ids) else int(
                    state.output_ids[end - len(state.prompt_ids)])
            seqs.append(ObservedSeq(r.seq.request_id, start, tokens, nxt,
                                    hidden[r.first_row: r.first_row + len(tokens)],
                                    inp.full_table, inp.full_kv_from))
        self.proposer.observe(seqs)

    @staticmethod
    def _result(plan: StepPlan, sampled: list[SeqRows], new, forward_ms: float,
                sample_ms: float) -> StepResult:
        tokens = [t for toks, _ in new for t in toks]
        logprobs = [lp for _, lps in new for lp in lps]
        result = StepResult(plan.step_id, pack_ids(tokens),
                            logprobs if any(lp is not None for lp in logprobs) else [],
                            forward_ms=forward_ms, sample_ms=sample_ms)
        if any(seq.draft_slots for seq in plan.seqs):
            result.num_sampled = pack_ids([len(toks) for toks, _ in new])
            result.num_drafts = pack_ids([len(r.draft.tokens) if r.draft else 0
                                          for r in sampled])
        return result

    @torch.inference_mode()
    def all_logits(self, plan: StepPlan) -> torch.Tensor:
        """Logits at every position of the plan (prompt logprobs; reference tests)."""
        self._update_states(plan)
        inputs = resolve_inputs(plan, self.states, self.groups)
        return self.model.compute_logits(self._run(build_batch(
            plan, inputs, self.states, self.groups, {})))
