"""Runs one StepPlan: builds the batch, runs the model over the paged cache, samples.

A step is a short pipeline: resolve the seqs' inputs, ask speculation for drafts, build the
batch (step_batch.py), run the model, compute logits where tokens are drawn, mask them with the
requests' grammars (workers/structured), draw (workers/sample; drafts verified by the rejection
sampler, keeping a prefix of them plus one token of the target's), then update the requests'
states and tell speculation what was kept (workers/spec_decode/speculation.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.kv_identity import adapter_salt
from deepinfer.engine.protocol import (
    CompileGrammar,
    LoRAUpdate,
    LoRAUpdated,
    StepPlan,
    StepResult,
    pack_ids,
    unpack_ids,
)
from deepinfer.workers import deterministic
from deepinfer.workers.attention import AttentionMetadata, select_backend
from deepinfer.workers.cuda_graphs import DecodeGraphs, capture_sizes
from deepinfer.workers.distributed.parallel_state import group, tp
from deepinfer.workers.kv_cache import KVCache
from deepinfer.workers.kv_connectors import WorkerConnector, build_worker_connectors
from deepinfer.workers.kv_connectors.base import before_forward as connectors_before_forward
from deepinfer.workers.loader import DTYPES, load_model
from deepinfer.workers.lora.adapters import CURRENT, step_adapters, step_slots
from deepinfer.workers.lora.resident import ResidentAdapters, load_failure
from deepinfer.workers.sample.prompt_logprobs import prompt_logprobs
from deepinfer.workers.sample.sampler import Sampler, SamplingState
from deepinfer.workers.sample.step import NewTokens, SeqToSample, rows_of, sample_step
from deepinfer.workers.spec_decode.factory import build_proposer
from deepinfer.workers.spec_decode.speculation import Speculation
from deepinfer.workers.step_batch import (
    SeqRows,
    StepBatch,
    build_batch,
    logit_rows,
    prompt_targets,
    resolve_inputs,
)
from deepinfer.workers.structured.compile_service import GrammarCompileService
from deepinfer.workers.structured.masks import MaskedRows, accept, constrain

log = logging.getLogger("deepinfer.worker")


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
        copies = deterministic.WEIGHT_COPIES if config.deterministic else config.cpu_linear_weights
        self.model = load_model(config.resolved_model_dir(), config.dtype, copies, self.attention,
                                quantization=config.quantization, device=device)
        if config.deterministic:  # batch- and chunk-invariant kernels (workers/deterministic.py)
            deterministic.make_row_invariant(self.model, self.attention)
        layout = config.kv_cache_layout()
        self.groups = [g.kind for g in layout.groups()]
        self.windows = [g.window for g in layout.groups()]
        self.block_size = config.block_size
        self.num_blocks = config.kv_blocks()
        self.tp = tp()  # tensor parallelism: this rank holds its share of the KV heads
        self.group = group()  # rank 0 samples for every rank
        # One (K, V) pair per cache entry, in --kv-cache-dtype (auto: the model's).
        self.kv_caches = KVCache(layout.layers, self.num_blocks, self.block_size,
                                 DTYPES[config.kv_dtype()], device, self.tp)
        # Multi-LoRA (workers/lora): adapters on the linears; the fused one-call decode layer
        # and CUDA graphs know nothing of them.
        self.lora = ResidentAdapters(self.model, config.lora_adapters(), config.max_lora_rank,
                                     config.max_cpu_loras) if config.enable_lora else None
        self.lora_errors: dict[str, str] = {}  # this step's adapters that could not be read
        if self.lora is not None:
            for module in self.model.modules():
                if hasattr(module, "fast_layers"):
                    module.fast_layers = None
        self.graphs = None if self.lora is not None else self._decode_graphs()
        self.sampler = Sampler(config.seed)
        self.states: dict[str, SamplingState] = {}
        self.spec = Speculation(build_proposer(config, self.sampler, self.model))
        self._grammars: GrammarCompileService | None = None  # with the first structured request
        # The KV connectors' worker halves (workers/kv_connectors): the host tier copies a
        # proposer's own cache beside the target's.
        self.connectors: list[WorkerConnector] = build_worker_connectors(
            config, self.kv_caches, self.spec.caches(), transport)

    def _decode_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs of decode-only steps, where the forward can be one (workers/cuda_graphs.py);
        a capture that fails leaves the runner eager, with a warning."""
        if (self.device.type != "cuda" or self.config.enforce_eager
                or not self.attention.supports_cuda_graphs
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

    def _update_states(self, plan: StepPlan) -> None:
        connectors_before_forward(self.connectors, plan.connectors)
        for rid in plan.finished:
            self.states.pop(rid, None)
            if self._grammars is not None:
                self._grammars.forget(rid)
        self.spec.forget(plan.finished)
        for new in plan.new_requests:
            prompt = torch.from_numpy(unpack_ids(new.prompt_ids).copy())
            state = SamplingState.create(new.params, prompt)
            if new.params.grammar is not None:
                grammars = self.grammars
                state.grammar = grammars.backend.matcher(
                    grammars.take(new.request_id, new.params.grammar),
                    new.params.grammar.after, new.params.grammar.opened_by)
            if new.output_ids:  # a decode after a remote prefill: its first token is known
                first = unpack_ids(new.output_ids).tolist()
                state.output_ids.extend(first)
                if state.grammar is not None:
                    accept(state.grammar, first)
            self.states[new.request_id] = state

    def update_lora(self, msg: LoRAUpdate) -> LoRAUpdated | None:
        """Load or unload an adapter between steps (the scheduler sends an unload only once no
        request uses it); a load is answered, with the problem when it cannot be served."""
        if self.lora is None:
            return LoRAUpdated(msg.request_id, "LoRA is off (start with --enable-lora)")
        if msg.unload:
            self.lora.remove(msg.name)
            return None
        try:
            seconds = self.lora.add(msg.name, msg.path)
        except Exception as exc:  # noqa: BLE001 (e.g. damaged files: refused, the rank lives)
            return LoRAUpdated(msg.request_id, load_failure(msg.path, exc))
        # The scheduler's salt of its cache ids, from the very bytes attached.
        return LoRAUpdated(msg.request_id, seconds=seconds,
                           salt=adapter_salt(msg.name, self.lora.digests[msg.name]))

    def _run(self, batch: StepBatch) -> torch.Tensor:
        if self.lora is None:
            return self._forward(batch)
        # An adapter that cannot be read back: its rows run without it, its requests fail.
        slots, self.lora_errors = self.lora.use(step_adapters(batch))
        step_slots(batch, slots, self.device)
        try:
            return self._forward(batch)
        finally:
            CURRENT.slots = None

    def _forward(self, batch: StepBatch) -> torch.Tensor:
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
        self.lora_errors = {}
        result = self._execute(plan)
        result.lora_errors = self.lora_errors  # the scheduler fails these adapters' requests
        for connector in self.connectors:  # e.g. save the blocks this forward computed
            entry = plan.connectors.get(connector.name)
            if entry is not None:
                connector.after_forward(entry)
        return result

    def close(self) -> None:
        """The worker stops: the connectors finish what must not be lost."""
        for connector in self.connectors:
            connector.close()

    def _execute(self, plan: StepPlan) -> StepResult:
        self._update_states(plan)
        if not plan.seqs:  # only KV-transfer work in this plan
            return StepResult(plan.step_id, b"")
        t0 = time.perf_counter()
        inputs = resolve_inputs(plan, self.states, self.groups)
        drafts = self.spec.propose(plan.seqs, inputs, self.states)
        batch = build_batch(plan, inputs, self.states, self.groups, drafts)
        hidden = self._run(batch)
        # Rank 0 answers; the other ranks take part in the LM head's collective.
        prompt = prompt_logprobs(self.model.compute_logits, hidden, prompt_targets(batch.rows),
                                 self.group.rank == 0)
        sampled = [r for r in batch.rows if r.seq.sample]
        if not sampled:
            self.spec.observe(batch.rows, inputs, hidden)
            return StepResult(plan.step_id, b"", forward_ms=(time.perf_counter() - t0) * 1e3,
                              prompt_logprobs=prompt)
        index = logit_rows(sampled)
        logits = self.model.compute_logits(rows_of(hidden, index)).cpu()  # host sampling
        t1 = time.perf_counter()
        new = self._sample(logits, sampled)
        t2 = time.perf_counter()
        self._record(sampled, new)
        self.spec.record(sampled, new, hidden, index)
        self.spec.observe(batch.rows, inputs, hidden)
        result = self._result(plan, sampled, new, (t1 - t0) * 1e3, (t2 - t1) * 1e3)
        result.prompt_logprobs = prompt
        return result

    def _sample(self, logits: torch.Tensor, sampled: list[SeqRows]) -> list[NewTokens]:
        """Rank 0 masks the constrained rows and draws; with tensor parallelism the other ranks
        take its tokens (their request states, overlap placeholders and grammar matchers follow
        it)."""
        new: list[NewTokens] = []
        if self.group.rank == 0:
            masked = [MaskedRows(r.state.grammar, r.draft.tokens if r.draft else [], r.logit_row)
                      for r in sampled if r.state.grammar is not None]
            if masked:  # (a request with a grammar made the compile service)
                constrain(self.grammars.backend, logits, masked)
            new = sample_step(self.sampler, logits, [
                SeqToSample(r.state, r.logit_row) if r.draft is None
                else SeqToSample(r.state, r.logit_row, r.draft.tokens, r.draft.probs)
                for r in sampled])
        if self.group.world > 1:
            tokens = self.group.broadcast_lists([t for t, _ in new], len(sampled), self.device)
            if self.group.rank:
                new = [(t, [None] * len(t)) for t in tokens]
        return new

    @staticmethod
    def _record(sampled: list[SeqRows], new: list[NewTokens]) -> None:
        """The requests' own histories, and their grammars' matchers."""
        for r, (tokens, _) in zip(sampled, new):
            r.state.output_ids.extend(tokens)
            if r.state.grammar is not None:
                accept(r.state.grammar, tokens)

    @staticmethod
    def _result(plan: StepPlan, sampled: list[SeqRows], new: list[NewTokens], forward_ms: float,
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
