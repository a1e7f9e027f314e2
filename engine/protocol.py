"""Every message that crosses a process boundary, as msgspec Structs.

Structs are array-like (positional on the wire), omit defaults and skip GC tracking, as in vLLM v1.
Token id arrays travel as raw little-endian int32 bytes (`pack_ids` / `unpack_ids`), never as
lists of Python ints. A socket that carries several message types uses a tagged union.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec
import numpy as np

from deepinfer.engine.statistics import COUNTER, GAUGE, PER_POSITION, PHASE, stat

_STRUCT = dict(array_like=True, omit_defaults=True, gc=False)
# Every PHASE statistic is one label (its name without _seconds) of this counter.
PHASE_METRIC = "deepinfer_step_phase_seconds"
# What fits the int32 arrays ids travel in (a peer's larger id is refused where it enters).
Int32 = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]


def pack_ids(ids) -> bytes:
    """Token ids (any int sequence or array) -> raw int32 bytes."""
    return np.asarray(ids, dtype=np.int32).tobytes()


def unpack_ids(data: bytes) -> np.ndarray:
    """Raw int32 bytes -> read-only int32 array (zero copy)."""
    return np.frombuffer(data, dtype=np.int32)


class FinishReason(enum.IntEnum):
    STOP = 1  # EOS, a stop token id or a stop string
    LENGTH = 2  # max_tokens or the context length
    ABORT = 3  # client went away or the request was cancelled
    ERROR = 4  # the request was rejected (see RequestOutput.error)

    def openai(self) -> str | None:
        return {1: "stop", 2: "length", 3: "abort", 4: "error"}[int(self)]


class GrammarSpec(msgspec.Struct, **_STRUCT):
    """A structured-output constraint, as text the grammar backend compiles.

    kind: "json_schema" (spec: the schema as JSON text), "json_object" (any JSON object; no
    spec), "regex" or "ebnf" (a GBNF-style grammar whose start rule is `root`). A choice is sent
    as the EBNF of its alternatives.
    """

    kind: str
    spec: str = ""
    # Text the output must write before the grammar starts (a reasoning model's `</think>`):
    # the reasoning is free, the answer after it constrained.
    after: str = ""
    # With `after`: the reasoning is optional and opens with this (Qwen3's `<think>`, which the
    # model writes itself): an output that does not start with it follows the grammar at once.
    opened_by: str = ""

    def cache_key(self) -> tuple[str, str]:
        return (self.kind, self.spec)


class SampledLogprobs(msgspec.Struct, **_STRUCT):
    """One sampled position's logprobs as the worker computes them (token ids, no text)."""

    token_id: int
    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class PromptChunkLogprobs(msgspec.Struct, **_STRUCT):
    """Prompt logprobs of the consecutive prompt positions [start, start + count), as a worker
    computes them in one prefill chunk (position 0 has none: nothing precedes it). Per
    position: the prompt token's logprob and its rank among all tokens (1: the most likely),
    then the top-k ids and logprobs, [count, k] row-major. Raw little-endian arrays (float32
    logprobs, int32 ranks and ids), as token ids travel."""

    start: int
    logprobs: bytes
    ranks: bytes
    top_ids: bytes = b""
    top_logprobs: bytes = b""

    @property
    def count(self) -> int:
        return len(self.logprobs) // 4

    def since(self, position: int) -> PromptChunkLogprobs:
        """Only its positions from `position` on (a recomputed chunk overlaps what came)."""
        cut = min(max(position - self.start, 0), self.count)
        if not cut:
            return self
        k = len(self.top_ids) // 4 // self.count if self.count else 0
        return PromptChunkLogprobs(self.start + cut, self.logprobs[4 * cut:],
                                   self.ranks[4 * cut:], self.top_ids[4 * k * cut:],
                                   self.top_logprobs[4 * k * cut:])


class KVTransferParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Prefill/decode disaggregation: where a prompt's KV waits on a prefill server, as the
    prefill server's response gives it (a JSON object) and a decode server takes it back."""

    do_remote_prefill: bool  # what a decode server is asked to do with it (always true)
    transfer_id: Annotated[str, msgspec.Meta(max_length=256)]
    # The prefill server's workers' transfer sockets, one per rank (tcp://host:port#nonce).
    addresses: list[Annotated[str, msgspec.Meta(max_length=512)]] = []
    # Per KV group, the prefill server's block table (-1: a block it no longer holds).
    block_ids: list[list[Annotated[int, msgspec.Meta(ge=-1, le=2**31 - 1)]]]
    num_tokens: Int32  # prompt tokens the KV covers
    block_size: Annotated[int, msgspec.Meta(ge=1, le=2**16)]
    first_token: Int32  # the token the prefill sampled after the prompt
    kv_dtype: str = ""  # the prefill server's KV cache type (--kv-cache-dtype resolved)
    first_logprobs: SampledLogprobs | None = None
    # The LoRA adapter the KV was computed with (its salt, engine/kv_identity.py; 0: none).
    cache_salt: Annotated[int, msgspec.Meta(ge=0, le=2**31)] = 0
    # engine/trust.py: the prompt's token ids hashed (a decode server checks they are its
    # prompt's), and the prefill server's signature over every other field.
    prompt_digest: str = ""
    signature: str = ""


class SamplingParams(msgspec.Struct, kw_only=True, **_STRUCT):
    """Per-request generation settings (OpenAI names; vLLM-style extensions)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    # None: no logprobs. k >= 0: the chosen token's logprob plus the top-k alternatives.
    logprobs: int | None = None
    # The same for every prompt position (vLLM's prompt_logprobs): computed in the prefill,
    # so such a request does not start from a cached prefix (engine/scheduler/prompt_logprobs.py).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Per-request opt-out of speculative decoding (the engine decides when it is on).
    speculative: bool = True
    # Structured output: every sampled token must keep the output inside this grammar.
    grammar: GrammarSpec | None = None
    # Prefill/decode disaggregation: on a prefill server, keep the prompt's KV for a decode
    # server to pull (the finish reports where); on a decode server, pull it from there.
    remote_decode: bool = False
    remote_prefill: KVTransferParams | None = None
    # Multi-LoRA: the adapter this request runs with (its --lora-modules name; None: the base).
    lora: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    # vLLM's cache_salt: mixed into the identity of this request's KV blocks (every tier, KV
    # events), so only requests with the same salt share cached prefixes (engine/kv_identity.py).
    cache_salt: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)] | None = None

    def is_greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1  # tiny temperatures too (as vLLM)


# ---------------------------------------------------------------- api <-> tokenizer process


class ChatMessage(msgspec.Struct, **_STRUCT):
    role: str
    content: str
    # OpenAI tool calling: an assistant turn's calls ({"id", "type", "function": {"name",
    # "arguments"}}), a tool turn's answer to one of them.
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None  # an assistant turn's reasoning, sent back


class GenerateRequest(msgspec.Struct, tag=True, **_STRUCT):
    """A user request as the API layer received it (text, tokens or chat messages)."""

    request_id: str
    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: bytes | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    # The last message is an assistant's answer begun (a prefill): the model goes on from it.
    continue_final_message: bool = False
    # Function tools the chat template renders ({"type": "function", "function": {...}}).
    tools: list[dict] | None = None
    # More variables for the chat template (chat_template_kwargs; e.g. thinking on or off).
    template_kwargs: dict | None = None
    # Tokenize only (Anthropic's count_tokens): the tokenizer answers with the prompt's length
    # and a finish; nothing reaches the scheduler.
    count_only: bool = False


class Abort(msgspec.Struct, tag=True, **_STRUCT):
    """End requests early. ABORT: the client went away (nothing is kept); STOP: the tokenizer
    matched a stop string (a normal finish: the request's KV seeds the prefix cache)."""

    request_ids: list[str]
    reason: FinishReason = FinishReason.ABORT


class TokenLogprob(msgspec.Struct, **_STRUCT):
    token_id: int
    token: str
    logprob: float


class PositionLogprobs(msgspec.Struct, **_STRUCT):
    """Logprob of the chosen token at one position and the top alternatives."""

    chosen: TokenLogprob
    top: list[TokenLogprob] = []


class PromptLogprob(msgspec.Struct, **_STRUCT):
    """One prompt token of a request's prompt logprobs, with texts: its logprob, its rank among
    all tokens (1: the most likely) and the top alternatives; None at position 0, which
    nothing precedes."""

    token_id: int
    token: str
    logprob: float | None = None
    rank: int | None = None
    top: list[TokenLogprob] = []


class RequestOutput(msgspec.Struct, **_STRUCT):
    """An incremental result for one request: new text and tokens since the last output."""

    request_id: str
    text: str = ""
    token_ids: bytes = b""
    logprobs: list[PositionLogprobs] = []
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # Set only on the first output of a request: the prompt as the model saw it.
    prompt_text: str | None = None
    error: str | None = None
    replayed_tokens: int = 0
    kv_transfer: KVTransferParams | None = None  # a prefill server's held KV (last output)
    stop_reason: str | None = None  # the stop string that finished it (vLLM's name)
    # One per prompt token, when asked (SamplingParams.prompt_logprobs): only on the output
    # with the first new token (the last output, when none is generated).
    prompt_logprobs: list[PromptLogprob] = []


# Bounds (seconds) of the KV-transfer latency histogram (SchedulerStats.kv_transfer_buckets).
KV_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                       10.0, 30.0)


class AuditDivergence(msgspec.Struct, **_STRUCT):
    """A request whose cold re-run (--audit-rate) differed: the shortcuts the original took,
    the first position (0: its first generated token) where a token differed or a logprob moved
    past the tolerance, the largest logprob difference where the tokens agreed, and how many
    tokens were compared (engine/scheduler/audit.py)."""

    request_id: str
    shortcuts: list[str]
    position: int
    max_logprob_diff: float
    num_tokens: int


class SchedulerStats(msgspec.Struct, tag=True, **_STRUCT):
    """A snapshot the scheduler publishes after each step. Each statistic is declared here
    once (`stat`, engine/statistics.py): /metrics and the progress log line come from it."""

    num_running: Annotated[int, stat("requests being computed", GAUGE,
                                     "deepinfer_num_requests_running", log="running")] = 0
    num_waiting: Annotated[int, stat("requests waiting for a slot", GAUGE,
                                     "deepinfer_num_requests_waiting", log="waiting")] = 0
    kv_blocks_total: Annotated[int, stat("KV cache blocks in total", GAUGE,
                                         "deepinfer_kv_blocks_total", log="KV blocks")] = 0
    # Free or reclaimable (cached blocks no request uses).
    kv_blocks_free: Annotated[int, stat("KV cache blocks free", GAUGE,
                                        "deepinfer_kv_blocks_free", log="free")] = 0
    kv_blocks_cached: Annotated[int, stat("blocks held by the prefix cache", GAUGE,
                                          "deepinfer_kv_blocks_cached")] = 0
    prefix_cache_queries: Annotated[int, stat(
        "prompt tokens looked up in the prefix cache", COUNTER,
        "deepinfer_prefix_cache_queries_tokens")] = 0
    prefix_cache_hits: Annotated[int, stat(
        "prompt tokens served from the prefix cache", COUNTER,
        "deepinfer_prefix_cache_hits_tokens")] = 0
    prefix_cache_evictions: Annotated[int, stat(
        "blocks evicted from the prefix cache", COUNTER,
        "deepinfer_prefix_cache_evictions_blocks")] = 0
    replayed_tokens: Annotated[int, stat(
        "tokens recomputed to rebuild sliding windows after prefix hits", COUNTER,
        "deepinfer_swa_replayed_tokens")] = 0
    kv_events_dropped: Annotated[int, stat(
        "KV event batches dropped because the publisher's queue was full (--kv-events-config)",
        COUNTER, "deepinfer_kv_events_dropped_batches")] = 0
    swa_snapshot_hits: Annotated[int, stat(
        "prefix hits that resumed the sliding layers from a window snapshot", COUNTER,
        "deepinfer_swa_snapshot_hits")] = 0
    swa_snapshots: Annotated[int, stat(
        "sliding-window snapshots held by the prefix cache", GAUGE,
        "deepinfer_swa_snapshots")] = 0
    host_blocks_used: Annotated[int, stat("host-tier blocks in use", GAUGE,
                                          "deepinfer_host_kv_blocks_used")] = 0
    host_blocks_out: Annotated[int, stat("blocks copied to the host tier", COUNTER,
                                         "deepinfer_host_kv_blocks_out")] = 0
    host_blocks_in: Annotated[int, stat("blocks copied back from the host tier", COUNTER,
                                        "deepinfer_host_kv_blocks_in")] = 0
    # Per tier (device, host, disk): frontend/server/metrics.py renders them with a `tier`
    # label; the read/write seconds per block and their counts per bucket of
    # KV_TRANSFER_BUCKETS make the disk tier's histograms.
    host_hit_tokens: Annotated[int, stat("prompt tokens loaded from the host tier",
                                         COUNTER)] = 0
    host_block_bytes: Annotated[int, stat("bytes of one host-tier block", GAUGE)] = 0
    disk_hit_tokens: Annotated[int, stat("prompt tokens loaded from the disk tier",
                                         COUNTER)] = 0
    disk_blocks_used: Annotated[int, stat("blocks the disk tier knows on disk", GAUGE,
                                          "deepinfer_kv_disk_blocks_used")] = 0
    disk_used_bytes: Annotated[int, stat("bytes of the disk tier's blocks (all ranks)", GAUGE,
                                         "deepinfer_kv_disk_used_bytes")] = 0
    disk_corrupt_blocks: Annotated[int, stat(
        "disk-tier blocks found damaged, truncated or foreign, deleted and recomputed",
        COUNTER, "deepinfer_kv_disk_corrupt_blocks")] = 0
    disk_bytes_read: Annotated[int, stat("bytes read from the disk tier", COUNTER)] = 0
    disk_bytes_written: Annotated[int, stat("bytes written to the disk tier", COUNTER)] = 0
    disk_read_seconds: Annotated[float, stat("seconds of disk-tier block reads", COUNTER)] = 0.0
    disk_read_buckets: Annotated[list[int], stat(
        "disk-tier block reads per bucket of seconds", PER_POSITION)] = []
    disk_write_seconds: Annotated[float, stat("seconds of disk-tier block writes",
                                              COUNTER)] = 0.0
    disk_write_buckets: Annotated[list[int], stat(
        "disk-tier block writes per bucket of seconds", PER_POSITION)] = []
    # Prefill/decode disaggregation: what was sent (prefill) or received (decode). Finished
    # transfers' count, seconds and counts per bucket of KV_TRANSFER_BUCKETS make the
    # deepinfer_kv_transfer_seconds histogram (frontend/server/metrics.py).
    kv_transfer_blocks: Annotated[int, stat("KV blocks transferred", COUNTER,
                                            "deepinfer_kv_transfer_blocks")] = 0
    kv_transfer_bytes: Annotated[int, stat("KV bytes transferred (all ranks)", COUNTER,
                                           "deepinfer_kv_transfer_bytes")] = 0
    kv_transfer_count: Annotated[int, stat("KV transfers finished", COUNTER)] = 0
    kv_transfer_seconds: Annotated[float, stat("seconds of finished KV transfers",
                                               COUNTER)] = 0.0
    kv_transfer_buckets: Annotated[list[int], stat(
        "finished KV transfers per bucket of seconds", PER_POSITION)] = []
    kv_transfers_pending: Annotated[int, stat(
        "KV transfers under way: prompts held for a decode server (prefill) or being pulled "
        "(decode)", GAUGE, "deepinfer_kv_transfers_pending")] = 0
    spec_verify_steps: Annotated[int, stat(
        "(request, step) pairs that verified at least one draft", COUNTER,
        "deepinfer_spec_decode_verify_steps")] = 0
    spec_draft_tokens: Annotated[int, stat("draft tokens verified", COUNTER,
                                           "deepinfer_spec_decode_draft_tokens")] = 0
    spec_accepted_tokens: Annotated[int, stat("draft tokens the target model accepted",
                                              COUNTER, "deepinfer_spec_decode_accepted_tokens")
                                    ] = 0
    spec_drafts_by_position: Annotated[list[int], stat(
        "draft tokens verified at each draft position", PER_POSITION,
        "deepinfer_spec_decode_draft_tokens_per_position")] = []
    spec_accepted_by_position: Annotated[list[int], stat(
        "draft tokens accepted at each draft position", PER_POSITION,
        "deepinfer_spec_decode_accepted_tokens_per_position")] = []
    num_preemptions: Annotated[int, stat("requests preempted", COUNTER,
                                         "deepinfer_num_preemptions")] = 0
    num_steps: Annotated[int, stat("scheduler steps", COUNTER, "deepinfer_engine_steps")] = 0
    # Counted as each step computes them (the server's deepinfer_prompt_tokens and
    # deepinfer_generation_tokens count finished requests): live rates for dashboards.
    prompt_tokens_total: Annotated[int, stat("prompt tokens computed, as each step computes them",
                                             COUNTER, "deepinfer_engine_prompt_tokens",
                                             log="prompt tok/s")] = 0
    generation_tokens_total: Annotated[int, stat(
        "tokens generated, as each step generates them", COUNTER,
        "deepinfer_engine_generation_tokens", log="gen tok/s")] = 0
    # The exactness audit (--audit-rate; engine/scheduler/audit.py). Divergences per shortcut
    # render as deepinfer_audit_divergences_total{shortcut=...} (frontend/server/metrics.py);
    # the latest ones are GET /v1/audit's.
    audit_requests: Annotated[int, stat("finished requests re-run cold and compared", COUNTER,
                                        "deepinfer_audit_requests")] = 0
    audit_divergences: dict[str, int] = {}
    audit_largest_logprob_diff: Annotated[float, stat(
        "largest logprob difference between a request and its cold re-run where their tokens "
        "agreed", GAUGE, "deepinfer_audit_max_logprob_diff")] = 0.0
    audit_pending: Annotated[int, stat("finished requests waiting for their cold re-run", GAUGE,
                                       "deepinfer_audit_pending")] = 0
    audit_latest: list[AuditDivergence] = []
    # Cumulative seconds per phase of a step (engine overhead = everything but forward).
    schedule_seconds: Annotated[float, stat(
        "scheduler: picking the batch, building the plan", PHASE, PHASE_METRIC,
        log="schedule")] = 0.0
    update_seconds: Annotated[float, stat("scheduler: applying results", PHASE, PHASE_METRIC,
                                          log="update")] = 0.0
    wait_seconds: Annotated[float, stat("scheduler: waiting for the workers (IPC + compute)",
                                        PHASE, PHASE_METRIC)] = 0.0
    forward_seconds: Annotated[float, stat("worker: model forward", PHASE, PHASE_METRIC,
                                           log="forward")] = 0.0
    sample_seconds: Annotated[float, stat("worker: sampling", PHASE, PHASE_METRIC,
                                          log="sample")] = 0.0
    detokenize_seconds: Annotated[float, stat(
        "tokenizer: detokenization and stop strings", PHASE, PHASE_METRIC)] = 0.0


class OutputBatch(msgspec.Struct, tag=True, **_STRUCT):
    outputs: list[RequestOutput]
    stats: SchedulerStats | None = None
    lora_updates: list[LoRAUpdated] = []  # answers to LoRAUpdate messages


# ---------------------------------------------------------------- tokenizer <-> scheduler


class LoRAUpdate(msgspec.Struct, tag=True, **_STRUCT):
    """Load (a path given) or unload a LoRA adapter at run time (--allow-runtime-lora-updating):
    client -> tokenizer -> scheduler -> workers. A load is answered once the workers attached it
    (or found it unservable); an unload once no request uses the adapter any more."""

    request_id: str
    name: Annotated[str, msgspec.Meta(max_length=256)]
    path: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    unload: bool = False


class LoRAUpdated(msgspec.Struct, tag=True, **_STRUCT):
    """The answer to a LoRAUpdate (worker rank 0 -> scheduler -> tokenizer -> client): error
    names why an adapter cannot be served; seconds: how long reading and attaching it took. The
    workers compute the salt from the files they read (the scheduler may not see them later)."""

    request_id: str
    error: str | None = None
    seconds: float = 0.0
    salt: int = 0  # a loaded adapter's salt in the prefix cache's ids (engine/kv_identity.py)


class TokenizedRequest(msgspec.Struct, tag=True, **_STRUCT):
    request_id: str
    prompt_ids: bytes
    params: SamplingParams


class TokenDelta(msgspec.Struct, **_STRUCT):
    request_id: str
    token_ids: bytes
    logprobs: list[SampledLogprobs] = []  # one per new token, only when asked for
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (never > prompt_tokens)
    error: str | None = None
    replayed_tokens: int = 0  # recomputed to rebuild sliding windows after a prefix hit
    kv_transfer: KVTransferParams | None = None  # the KV held for a decode server (prefill)
    # Prompt logprobs, in position order, when asked: every one on the request's first delta
    # that has a token or a finish (the scheduler holds them until then).
    prompt_logprobs: list[PromptChunkLogprobs] = []


class TokenBatch(msgspec.Struct, tag=True, **_STRUCT):
    deltas: list[TokenDelta]
    stats: SchedulerStats | None = None
    lora_updates: list[LoRAUpdated] = []


# ---------------------------------------------------------------- scheduler <-> workers


class NewRequestInfo(msgspec.Struct, **_STRUCT):
    """Sent to the workers once per request: what sampling needs for its whole life."""

    request_id: str
    prompt_ids: bytes
    params: SamplingParams
    output_ids: bytes = b""  # tokens it already has (the first, from a prefill server)


class KVPull(msgspec.Struct, **_STRUCT):
    """Decode side: copy a request's prompt KV from a prefill server's blocks into ours.
    `blocks` per KV group: int32 pairs (remote block, local block). `abandon`: copy nothing,
    only tell the prefill server its hold is no longer wanted (the request ended before it was
    admitted)."""

    request_id: str
    transfer_id: str
    addresses: list[str]
    blocks: list[bytes]
    abandon: bool = False


class KVHold(msgspec.Struct, **_STRUCT):
    """Prefill side: a finished prompt's blocks, held for a decode server. A transfer socket
    serves a read only of a transfer held now, and only of its own blocks (int32 ids per KV
    group)."""

    transfer_id: str
    blocks: list[bytes]


class ScheduledSeq(msgspec.Struct, **_STRUCT):
    """One request's slice of a step: compute `token_ids` at positions start.. and maybe sample.

    Empty `token_ids` is the overlap placeholder: "the token you sampled for this request in
    the previous step", which the scheduler does not know yet when it plans this one.
    """

    request_id: str
    token_ids: bytes
    start_pos: int
    # One block table per KV group (ModelConfig.kv_groups order); -1 marks a block freed
    # because it fell out of a sliding window.
    block_tables: list[bytes]
    sample: bool
    # Full-attention layers already hold K/V below this position (a prefix-cache hit being
    # replayed for sliding layers): they must not write there, only attend.
    full_kv_from: int = 0
    # Sliding layers hold no K/V below this position (replay start): keys there are masked.
    window_from: int = 0
    # Speculative decoding: KV slots reserved after the input token for up to this many draft
    # tokens, which the worker proposes and verifies in this step (0: a plain decode).
    draft_slots: int = 0
    # Compute the prompt logprobs of the prompt positions this chunk's logits predict.
    prompt_logprobs: bool = False


class HostTierCopies(msgspec.Struct, tag="host_tier", **_STRUCT):
    """The host tier's copies of full-attention blocks, run before the forward in this order:
    saves, int32 pairs (device block, host block), then loads, (host block, device block)."""

    saves: bytes = b""
    loads: bytes = b""


class TransferWork(msgspec.Struct, tag="transfer", **_STRUCT):
    """Prefill/decode disaggregation: pulls to start and requests whose pulls stop (decode
    side); transfers now held, and transfer ids whose blocks are no longer held (prefill side:
    what a pull may read)."""

    pulls: list[KVPull] = []
    cancels: list[str] = []
    held: list[KVHold] = []
    released: list[str] = []


# One step's entry for one KV connector (engine/kvcache/connectors): a new connector adds its
# type here.
class DiskLoad(msgspec.Struct, **_STRUCT):
    """Read a request's blocks from the disk tier into these device blocks (int32), in order;
    `digests`: their 32-byte chained digests, concatenated. `window_blocks`: sliding-window
    blocks to read the snapshot `window_digest` into (after the full blocks)."""

    request_id: str
    blocks: bytes
    digests: bytes
    window_blocks: bytes = b""
    window_digest: bytes = b""


class WindowSave(msgspec.Struct, **_STRUCT):
    """A sliding-window snapshot to save: its sliding blocks (int32) under one name."""

    digest: bytes
    blocks: bytes


class DiskTierWork(msgspec.Struct, tag="disk_tier", **_STRUCT):
    """The disk tier's work (engine/kvcache/connectors/disk_tier.py). Saves are device blocks
    (int32) and their digests (32 bytes each, concatenated): `saves` are copied after this
    step's forward (it may be what computes them), `saves_now` before it (blocks evicted in
    this plan, computed earlier, that the forward may overwrite). `loads` run off the step
    loop and report back (KVTransferDone); `deletes` are digests to remove (LRU by size)."""

    saves: bytes = b""
    save_digests: bytes = b""
    saves_now: bytes = b""
    save_now_digests: bytes = b""
    loads: list[DiskLoad] = []
    deletes: bytes = b""
    window_saves: list[WindowSave] = []  # after the forward, as `saves`


KVConnectorMeta = HostTierCopies | TransferWork | DiskTierWork


class StepPlan(msgspec.Struct, tag=True, **_STRUCT):
    step_id: int
    seqs: list[ScheduledSeq]
    new_requests: list[NewRequestInfo] = []
    # Requests the workers may forget (finished, aborted): their sampling state is dropped.
    finished: list[str] = []
    # Each KV connector's work for this step, by connector name, run before the forward.
    connectors: dict[str, KVConnectorMeta] = {}


class CompileGrammar(msgspec.Struct, tag=True, **_STRUCT):
    """Compile a request's grammar before it is scheduled (workers compile off their step loop;
    rank 0 answers with GrammarReady)."""

    request_id: str
    grammar: GrammarSpec


class GrammarReady(msgspec.Struct, tag=True, **_STRUCT):
    """A request's grammar compiled (error None) or was refused (error names the problem)."""

    request_id: str
    error: str | None = None


class KVTransferDone(msgspec.Struct, tag=True, **_STRUCT):
    """A worker rank's KV-transfer thread to its scheduler. Prefill side (sent): a decode
    server confirmed (or gave up) transfer `transfer_id`. Decode side (received): the pull for
    `transfer_id` (our request id) ended; `error` when it failed, `cancelled` when the request
    was aborted meanwhile."""

    transfer_id: str
    rank: int
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None
    cancelled: bool = False
    damaged: int = 0  # disk tier: block files found damaged (deleted; the block is recomputed)


class Shutdown(msgspec.Struct, tag=True, **_STRUCT):
    reason: str = ""


class StepResult(msgspec.Struct, tag=True, **_STRUCT):
    """Rank 0's answer: the new tokens of every seq with sample=True, in plan order.

    A plain seq gets one token; a speculating one 1..draft_slots+1 (its accepted drafts, then
    the target's own next token). `num_sampled` (int32 per sampled seq) is empty when every
    seq got exactly one; `num_drafts` (int32 per sampled seq) says how many drafts the worker
    proposed for it, empty when none speculated.
    """

    step_id: int
    sampled_ids: bytes  # int32, all new tokens back to back
    logprobs: list[SampledLogprobs | None] = []  # per new token, when any request asked
    num_sampled: bytes = b""
    num_drafts: bytes = b""
    forward_ms: float = 0.0
    sample_ms: float = 0.0
    # One per seq whose plan asked prompt_logprobs, in plan order.
    prompt_logprobs: list[PromptChunkLogprobs] = []
    # LoRA adapter -> why it could not be read back for this step (evicted, then its files
    # gone, damaged or changed): its rows ran without it, so its requests in the step fail.
    lora_errors: dict[str, str] = {}


# ---------------------------------------------------------------- children -> launcher


class ProcessReady(msgspec.Struct, tag=True, **_STRUCT):
    name: str
    info: dict[str, str] = {}


class ProcessFailed(msgspec.Struct, tag=True, **_STRUCT):
    name: str
    error: str


# What each process's one inbound socket carries.
# From the client and the scheduler.
TokenizerInbound = GenerateRequest | Abort | LoRAUpdate | TokenBatch
# From the tokenizer, worker rank 0 and every rank's KV-transfer thread.
class DiskWrites(msgspec.Struct, tag=True, **_STRUCT):
    """A worker rank's disk-tier writer to its scheduler: blocks it wrote since its last report
    (each one's seconds), and digests it could not write (a full or failing disk)."""

    rank: int
    blocks: int = 0
    nbytes: int = 0
    seconds: list[float] = []
    failed: bytes = b""


SchedulerInbound = (TokenizedRequest | Abort | StepResult | GrammarReady | KVTransferDone
                    | DiskWrites | LoRAUpdate | LoRAUpdated)
WorkerInbound = StepPlan | CompileGrammar | LoRAUpdate | Shutdown  # from the scheduler
ControlMessage = ProcessReady | ProcessFailed  # children -> launcher

