"""Engine configuration: one msgspec Struct shared by every process.

The scheduler and the workers derive the same number of KV blocks from it (see `num_kv_blocks`),
so no process has to ask another how big the cache is. The model's own config is the typed
ModelConfig of engine/model_config.py.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

import msgspec

from deepinfer.engine import envs
from deepinfer.engine.kv_layout import KV, KVCacheLayout
from deepinfer.engine.model_config import FULL, SLIDING, ModelConfig, ModelConfigError
from deepinfer.engine.model_registry import tensor_parallel_architectures
from deepinfer.engine.settings import Annotated, check_settings, setting

__all__ = ["EngineConfig", "ModelConfig", "ModelConfigError", "FULL", "SLIDING",
           "DEFAULT_MODEL_NAME", "SPECULATIVE_METHODS", "MAX_SPECULATIVE_TOKENS",
           "DISAGGREGATION_MODES", "KV_TRANSFER_BACKENDS", "QUANTIZATIONS", "DEVICES",
           "KV_CACHE_DTYPES", "MODEL_DTYPES", "SWA_REPLAYS", "CPU_LINEAR_WEIGHTS",
           "KVEventsConfig", "offset_endpoint"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SPECULATIVE_METHODS = ("ngram", "draft", "mtp", "dspark")
DISAGGREGATION_MODES = ("none", "prefill", "decode")
KV_TRANSFER_BACKENDS = ("zmq", "nixl")
# --dtype: the model's weights and activations (workers/loader.py maps them to torch dtypes).
MODEL_DTYPES = ("float32", "float16", "bfloat16")
# --swa-replay: after a prefix hit, sliding-window layers rebuild their window by replaying
# tokens: "window" replays W tokens (bounded, approximate beyond the first sliding layer);
# "exact" replays sliding_layers * W tokens (identical to a cold run).
SWA_REPLAYS = ("window", "exact")
# --cpu-linear-weights: copies of each linear weight on CPU: both (fastest at every batch
# size, 2x memory), packed (oneDNN only), plain (small-M kernel, F.linear above 4 rows), auto
# (both while the second copy costs at most a quarter of RAM).
CPU_LINEAR_WEIGHTS = ("auto", "both", "packed", "plain")
# --quantization: weights as stored (none: float, dequantizing a quantized checkpoint), int8
# (weight-only, per output channel, quantized at load) or fp8 (e4m3, 128 x 128 block scales).
QUANTIZATIONS = ("none", "int8", "fp8")
# --kv-cache-dtype: what the paged KV cache stores. auto: --dtype. float16 / bfloat16 under a
# float32 model halve the cache's bytes (twice the tokens in the same --kv-cache-gb, half the
# bytes decode attention reads); attention still computes in float32.
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")
# --device: where the workers compute. auto: a CUDA GPU per rank when torch sees one, else the
# CPU (workers/device.py resolves it in each worker, the only processes that import torch).
DEVICES = ("auto", "cpu", "cuda")
# Servers and nodes that talk to each other authenticate with a shared secret (engine/trust.py).
_NEEDS_SECRET = ("{what} needs the cluster secret, the same on {who}: set "
                 "DEEPINFER_CLUSTER_SECRET, or --cluster-secret-file FILE")
# What `pip install 'deepinfer[nixl]'` (nixl-cu12) or `pip install nixl` (both) put in place.
_NIXL_MODULES = ("nixl_cu12", "nixl_cu13")
# More drafts than this are almost never accepted and make every verify step wider.
MAX_SPECULATIVE_TOKENS = 16
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True):
    """--kv-events-config: vLLM's KVEventsConfig fields, same names and meaning."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" (the default once enabled) or "null"
    # PUB: [topic, seq, payload] per batch. Loopback unless told otherwise (vLLM binds every
    # interface): the events carry every cached prompt's token ids.
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None  # ROUTER: batches from a sequence number on
    buffer_steps: Annotated[int, msgspec.Meta(ge=1)] = 10_000  # batches kept for replay
    hwm: Annotated[int, msgspec.Meta(ge=0)] = 100_000  # the PUB socket's send high-water mark
    max_queue_size: Annotated[int, msgspec.Meta(ge=1)] = 100_000  # batches waiting to be sent
    topic: str = ""


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """A data-parallel replica's own endpoint: tcp ports plus `rank`, ipc paths suffixed."""
    if endpoint is None or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


class EngineConfig(msgspec.Struct, kw_only=True):
    """Every engine setting, declared once: its type, default, help (the `deepinfer serve` /
    `generate` flag --name-with-dashes and the offline `LLM` keyword share it) and the values it
    takes (`setting`, engine/settings.py); every construction refuses the rest, by flag."""

    # The model: a HF-layout directory, a GGUF file or a named model (frontend/cli.py's --model
    # lists the names).
    model: str = "default"
    served_model_name: Annotated[list[str] | str | None, setting(
        "model name in the API (default: the directory's name); more names are aliases a "
        "request may use, and a name with * or ? a pattern (quote it: 'claude-*' serves "
        "Claude Code's model names); responses name the first")] = None
    dtype: Annotated[str, setting(
        "the model's dtype, weights and activations: float32 (default), float16, bfloat16; the "
        "KV cache's too unless --kv-cache-dtype says otherwise", MODEL_DTYPES)] = "float32"
    kv_cache_dtype: Annotated[str, setting(
        "what the KV cache stores: auto (--dtype, default), float32, float16 or bfloat16 (half "
        "the bytes of float32: twice the tokens per --kv-cache-gb, faster decode attention; "
        "attention computes in float32)", KV_CACHE_DTYPES)] = "auto"
    block_size: Annotated[int, setting("tokens per KV block", at_least=1)] = 16
    # KV cache size: an explicit block count wins over a memory budget.
    num_kv_blocks: Annotated[int | None, setting(
        "KV cache size in blocks (overrides --kv-cache-gb)", at_least=1)] = None
    kv_cache_gb: Annotated[float, setting("KV cache budget in GiB", positive=True)] = 1.0
    max_num_seqs: Annotated[int, setting("most requests in one batch", at_least=1)] = 64
    # 256 keeps ITL p99 under 3x its median at 64 concurrent requests on 2 cores (BENCHMARKS.md).
    max_num_batched_tokens: Annotated[int, setting(
        "token budget of one step (default 256: on a small CPU it keeps inter-token latency "
        "steady while prompts are prefilled)", at_least=1)] = 256
    prefill_chunk_size: Annotated[int, setting(
        "longest prefill chunk of one request in a step", at_least=1)] = 512
    max_model_len: Annotated[int | None, setting(
        "context length (default: the model's)", at_least=1)] = None
    tensor_parallel_size: Annotated[int, setting(
        "worker ranks sharing the model (tensor parallelism)", at_least=1)] = 1
    enable_expert_parallel: Annotated[bool, setting(
        "with --tensor-parallel-size N: split each MoE layer's experts whole over the ranks, "
        "dense layers replicated (default off: tensor parallelism)")] = False
    # Multi-node: the worker ranks spread evenly over the hosts; node 0 runs the API server,
    # tokenizer and scheduler too; the scheduler's plans to the ranks go to the ports after
    # the rendezvous's.
    nnodes: Annotated[int, setting(
        "hosts the worker ranks spread over (default 1)", at_least=1)] = 1
    node_rank: Annotated[int, setting(
        "this host's index among --nnodes; node 0 runs the API server", at_least=0)] = 0
    dist_init_addr: Annotated[str | None, setting(
        "HOST:PORT of node 0 for the ranks' rendezvous (multi-node; default "
        "MASTER_ADDR:MASTER_PORT)")] = None
    enable_prefix_caching: Annotated[bool, setting(
        "reuse KV of shared prompt prefixes (default on)")] = True
    host_kv_cache_gb: Annotated[float, setting(
        "host-memory tier for evicted prefix-cache blocks (0: off)", at_least=0)] = 0.0
    # Multi-LoRA (workers/lora): adapters picked per request by `model`.
    enable_lora: Annotated[bool, setting(
        "serve LoRA adapters on the base model (--lora-modules; default off)")] = False
    lora_modules: Annotated[list[str] | None, setting(
        "LoRA adapters to serve, NAME=PATH each (a PEFT adapter directory); a request picks "
        "one by its `model`")] = None
    max_lora_rank: Annotated[int, setting(
        "the largest adapter rank accepted (default 16)", at_least=1)] = 16
    max_loras: Annotated[int | None, setting(
        "adapters one batch may use; requests of another adapter wait (default: all)",
        at_least=1)] = None
    max_cpu_loras: Annotated[int | None, setting(
        "adapters kept loaded in the workers' memory, the least recently used unloaded beyond "
        "(reloaded from their path when asked for again; default: all; at least --max-loras)",
        at_least=1)] = None
    allow_runtime_lora_updating: Annotated[bool, setting(
        "POST /v1/load_lora_adapter and /v1/unload_lora_adapter change the adapters while "
        "serving (a client then names directories on this machine: keep it behind --api-key)"
    )] = False
    # The disk tier (engine/kvcache/connectors/disk_tier.py): blocks named by their chained
    # digest, so servers of the same model may share one directory.
    kv_disk_path: Annotated[str | None, setting(
        "directory of a persistent disk tier for prefix-cache blocks, shared by any server of "
        "the same model that names it (must exist and be writable; default off)")] = None
    kv_disk_gb: Annotated[float, setting(
        "size of the disk tier: least recently used blocks go beyond it (default 64)",
        positive=True)] = 64.0
    # "window" replays W tokens (bounded, approximate beyond the first sliding layer);
    # "exact" replays sliding_layers * W tokens (identical to a cold run).
    swa_replay: Annotated[str, setting(
        "sliding-window rebuild after a prefix hit: window (W tokens) or exact",
        SWA_REPLAYS)] = "window"
    # None: every window W (then a hit along a cached prompt always finds one within W, and
    # replays from it exactly).
    swa_snapshot_interval: Annotated[int | None, setting(
        "keep a sliding-window snapshot every this many prompt tokens (default: the window W; "
        "0: only where prompts and requests end)", at_least=0)] = None
    # engine/scheduler/audit.py: re-runs cold in idle time only; divergences by shortcut.
    audit_rate: Annotated[float, setting(
        "fraction of finished requests re-run cold (no prefix cache, no speculation, exact "
        "sliding windows, a batch of their own) while the server is idle, their tokens and "
        "logprobs compared with what was served (/metrics, GET /v1/audit; default 0: off)",
        at_least=0)] = 0.0
    deterministic: Annotated[bool, setting(
        "bit-identical tokens and logprobs for a request whatever shares its batch, however its "
        "prompt is chunked and wherever its prefix's KV came from (slower: row-invariant "
        "kernels; default off)")] = False
    overlap_scheduling: Annotated[bool, setting(
        "plan the next step while the workers compute (default on)")] = True
    seed: Annotated[int, setting("engine seed")] = 0
    device: Annotated[str, setting(
        "where the workers compute: auto (a CUDA GPU per rank when torch sees one, else the "
        "CPU; default), cpu, cuda", DEVICES)] = "auto"
    enforce_eager: Annotated[bool, setting(
        "GPU: run decode steps without CUDA graphs (default: graphs for decode-only steps of "
        "the Llama family on one GPU)")] = False
    worker_threads: Annotated[int | None, setting(
        "intra-op threads per worker (default: its cores)", at_least=1)] = None
    # int8 / 4-bit weights: the integer GEMM's repacked copy is the second one (kept with both).
    cpu_linear_weights: Annotated[str, setting(
        "copies of each linear weight on CPU: both (fastest, 2x memory), packed, plain, or auto "
        "(both while cheap, default)", CPU_LINEAR_WEIGHTS)] = "auto"
    # None: as the checkpoint has them (an fp8 checkpoint's config says so, a GGUF's tensors
    # keep their types, anything else stays float).
    quantization: Annotated[str | None, setting(
        "linear weights: int8 (weight-only, per channel, quantized at load), fp8 (e4m3 block "
        "scales), none (float; dequantizes a quantized checkpoint); default: as the checkpoint "
        "stores them (a GGUF keeps its types)", QUANTIZATIONS)] = None
    speculative_method: Annotated[str | None, setting(
        "speculative decoding: ngram (prompt lookup), draft (a smaller model, "
        "--speculative-model), mtp (the model's multi-token heads) or dspark (a DSpark "
        "drafter, --speculative-model); default off",
        SPECULATIVE_METHODS)] = None
    num_speculative_tokens: Annotated[int, setting(
        f"draft tokens per step, 1 to {MAX_SPECULATIVE_TOKENS} (default 3: a batch-1 verify is "
        "4 rows)")] = 3
    speculative_model: Annotated[str | None, setting(
        "draft model (a directory, or a named model like --model) sharing the model's "
        "tokenizer; only with --speculative-method draft, or a DSpark drafter's directory "
        "with dspark")] = None
    speculative_confidence_threshold: Annotated[float | None, setting(
        "dspark: verify the longest draft prefix whose estimated acceptance (the confidence "
        "head's) is at least this (0: every draft slot; default: the drafter's config, else "
        "0.5)", at_least=0)] = None
    ngram_min: Annotated[int, setting(
        "ngram: shortest n-gram looked up in the request's tokens (default 2)", at_least=1)] = 2
    ngram_max: Annotated[int, setting("ngram: longest n-gram looked up (default 4)")] = 4
    speculative_disable_by_batch_size: Annotated[int | None, setting(
        "no speculation in a step with more running requests than this (default: no limit)",
        at_least=1)] = None
    grammar_compile_timeout: Annotated[float, setting(
        "structured output: seconds a grammar may take to compile before its request is "
        "refused (default 20)", positive=True)] = 20.0
    grammar_max_bytes: Annotated[int, setting(
        "structured output: longest schema, regex, EBNF or choice list accepted, in bytes "
        "(default 65536)", at_least=1)] = 65536
    # The API server's (frontend/server/responses/store.py): in memory, per server process.
    responses_store_size: Annotated[int, setting(
        "/v1/responses: finished responses kept (store: true) for GET and "
        "previous_response_id, least recently used first out (default 1000; 0: none)",
        at_least=0)] = 1000
    responses_store_mb: Annotated[float, setting(
        "/v1/responses: the stored responses' size bound in MiB, each counted with its whole "
        "conversation (default 256)", positive=True)] = 256.0
    # Either mode still serves ordinary requests (engine/kvcache/connectors/transfer.py).
    disaggregation_mode: Annotated[str, setting(
        "prefill/decode disaggregation: prefill (computes prompts and serves their KV to decode "
        "servers), decode (pulls that KV and continues), none (default)",
        DISAGGREGATION_MODES)] = "none"
    kv_transfer_host: Annotated[str, setting(
        "address the workers' KV-transfer sockets bind and advertise (default 127.0.0.1; use a "
        "reachable one across hosts)")] = "127.0.0.1"
    kv_transfer_timeout: Annotated[float, setting(
        "decode: seconds a KV pull may go unanswered before its request fails (default 30)",
        positive=True)] = 30.0
    kv_hold_timeout: Annotated[float, setting(
        "prefill: seconds a finished prompt's KV waits for a decode server to pull it before it "
        "is freed (default 120)", positive=True)] = 120.0
    # JSON, as vLLM's flag of the same name takes it (KVEventsConfig below).
    kv_events_config: Annotated[str | None, setting(
        "publish KV cache events for routers, in vLLM's format: JSON such as "
        "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": "
        "\"tcp://127.0.0.1:5557\", \"replay_endpoint\": \"tcp://127.0.0.1:5558\", "
        "\"topic\": \"kv-events\"}' (default off; the endpoint's default is loopback: the "
        "events carry every cached prompt's token ids)")] = None
    # Set per replica by `serve --data-parallel-size N` (vLLM's rule): a replica's KV events
    # carry it, and its event ports are the configured ones plus it.
    data_parallel_rank: Annotated[int, setting(
        "this server's index among data-parallel replicas: its KV events carry it and bind "
        "the --kv-events-config ports plus it (default 0)", at_least=0)] = 0
    kv_transfer_backend: Annotated[str, setting(
        "how KV blocks move between servers: zmq (over the transfer sockets, default) or nixl "
        "(NIXL READs; pip install 'deepinfer[nixl]')", KV_TRANSFER_BACKENDS)] = "zmq"

    def __post_init__(self) -> None:
        check_settings(self, ModelConfigError)
        self.kv_events()  # a bad --kv-events-config is refused up front

    def kv_events(self) -> KVEventsConfig | None:
        """--kv-events-config parsed, its ports offset by --data-parallel-rank; None: off."""
        if self.kv_events_config is None:
            return None
        try:
            events = msgspec.json.decode(self.kv_events_config, type=KVEventsConfig)
        except msgspec.DecodeError as e:
            raise ModelConfigError(f"--kv-events-config must be a JSON object of "
                                   f"{', '.join(KVEventsConfig.__struct_fields__)}: {e}") from None
        if not events.enable_kv_cache_events or events.publisher == "null":
            return None
        _require(events.publisher in (None, "zmq"), "--kv-events-config: publisher must be "
                                                    f"zmq or null, not {events.publisher!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(events, name)
            _require(value is None or value.startswith(("tcp://", "ipc://")),
                     f"--kv-events-config: {name} must be tcp://HOST:PORT or ipc://PATH, "
                     f"got {value!r}")
            if value is not None and value.startswith("tcp://"):
                port = value.rpartition(":")[2]
                _require(port.isdigit(), f"--kv-events-config: {name} needs a port, got "
                                         f"{value!r}")
        return msgspec.structs.replace(
            events, endpoint=offset_endpoint(events.endpoint, self.data_parallel_rank),
            replay_endpoint=offset_endpoint(events.replay_endpoint, self.data_parallel_rank))

    def resolved_model_dir(self) -> str:
        if self.model in ("default", DEFAULT_MODEL_NAME):
            return str(envs.cache_dir() / DEFAULT_MODEL_NAME)
        return self.model

    def _served_names(self) -> list[str]:
        names = self.served_model_name
        return [names] if isinstance(names, str) else list(names or [])

    def model_name(self) -> str:
        if names := self._served_names():
            return names[0]
        if self.model in ("default", DEFAULT_MODEL_NAME):
            return DEFAULT_MODEL_NAME
        return Path(self.model).name

    def model_aliases(self) -> tuple[str, ...]:
        """Other names (or fnmatch patterns) a request's `model` may give for the model."""
        return (self.model, *self._served_names()[1:])

    def check_speculative(self) -> None:
        """Raise ModelConfigError, naming the flag, if the speculative settings cannot work.

        Values only (no files are read), so a typo is reported before a model is prepared; the
        draft model's directory is checked by engine.model_store.ensure_config."""
        method = self.speculative_method
        k = self.num_speculative_tokens
        _require(method is None or 1 <= k <= MAX_SPECULATIVE_TOKENS,
                 f"--num-speculative-tokens must be between 1 and {MAX_SPECULATIVE_TOKENS}, "
                 f"got {k}")
        _require(self.ngram_min <= self.ngram_max,
                 f"--ngram-min ({self.ngram_min}) must not exceed --ngram-max ({self.ngram_max})")
        _require(method not in ("draft", "dspark") or bool(self.speculative_model),
                 f"--speculative-method {method} needs --speculative-model (the draft model's "
                 "directory)")
        _require(method in ("draft", "dspark") or self.speculative_model is None,
                 "--speculative-model is only used with --speculative-method draft or dspark")
        threshold = self.speculative_confidence_threshold
        _require(threshold is None or (method == "dspark" and threshold <= 1),
                 "--speculative-confidence-threshold is a probability for --speculative-method "
                 "dspark")

    def check_quantization(self) -> None:
        _require(self.quantization in (None, "none") or self.dtype == "float32",
                 f"--quantization {self.quantization} computes in float32 (not --dtype "
                 f"{self.dtype})")

    def kv_dtype(self) -> str:
        """The KV cache's element type: --kv-cache-dtype, or --dtype under auto."""
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    def check_kv_cache_dtype(self) -> None:
        """Raise ModelConfigError, naming the flag, for a KV cache type this model cannot keep.
        Reads the model's config: call it once --model is resolved."""
        if self.kv_dtype() == self.dtype:
            return
        other = sorted({layer.entry for layer in self.kv_cache_layout().layers} - {KV})
        _require(not other, f"--kv-cache-dtype {self.kv_cache_dtype}: the model's "
                            f"{', '.join(other)} cache entries keep --dtype {self.dtype} (only "
                            "key/value caches take another type so far)")

    def check_device(self) -> None:
        """Raise ModelConfigError, naming the flag, for a device that cannot run this config.

        Values only: whether CUDA is there is the workers' to find out (workers/device.py).
        The CUDA path runs float weights with the Triton attention backend; what it does not
        take yet is refused here when --device cuda says so, and by the worker under auto."""
        if self.device == "cuda":
            for problem in self.cpu_only_features():
                raise ModelConfigError(f"--device cuda: {problem}")

    def cpu_only_features(self) -> list[str]:
        """The settings that run on CPU workers only so far, each as a sentence."""
        out = []
        if self.quantization in ("int8", "fp8"):
            out.append(f"--quantization {self.quantization} runs on CPU workers only so far")
        if self.speculative_method in ("draft", "mtp", "dspark"):
            out.append(f"--speculative-method {self.speculative_method} runs on CPU workers "
                       "only so far (ngram works on either)")
        if self.disaggregation_mode != "none":
            out.append("--disaggregation-mode runs on CPU workers only so far")
        if self.kv_dtype() != self.dtype:
            out.append(f"--kv-cache-dtype {self.kv_cache_dtype} (other than --dtype) runs on "
                       "CPU workers only so far")
        return out

    def check_disaggregation(self) -> None:
        """Raise ModelConfigError, naming the flag, for unusable disaggregation settings."""
        # Found, not imported: importing NIXL loads torch, which this process need not.
        _require(self.kv_transfer_backend != "nixl" or
                 any(importlib.util.find_spec(m) for m in _NIXL_MODULES),
                 "--kv-transfer-backend nixl needs NIXL: pip install 'deepinfer[nixl]'")
        if self.disaggregation_mode != "none":
            _require(envs.cluster_secret() is not None, _NEEDS_SECRET.format(
                what=f"--disaggregation-mode {self.disaggregation_mode}",
                who="the PD router and every prefill and decode server"))
            _require(self.enable_prefix_caching,
                     "--disaggregation-mode needs the prefix cache (--enable-prefix-caching)")
            _require(self.nnodes == 1, "--disaggregation-mode runs on one node per server so "
                                       "far (not with --nnodes > 1)")

    def lora_adapters(self) -> dict[str, str]:
        """--lora-modules as {name: path} (empty without --enable-lora)."""
        if not self.enable_lora:
            return {}
        out = {}
        for item in self.lora_modules or []:
            name, sep, path = item.partition("=")
            _require(bool(sep and name and path), f"--lora-modules takes NAME=PATH, not {item!r}")
            _require(name not in out, f"--lora-modules: {name!r} is given twice")
            out[name] = path
        return out

    def check_lora(self) -> None:
        """Raise ModelConfigError for adapters that cannot be served with these settings."""
        adapters = self.lora_adapters()
        if not self.enable_lora:
            _require(not self.lora_modules, "--lora-modules needs --enable-lora")
            _require(not self.allow_runtime_lora_updating,
                     "--allow-runtime-lora-updating needs --enable-lora")
            return
        for name, path in adapters.items():
            # A request's `model` naming it would reach the base model instead.
            _require(name not in (self.model_name(), self.model),
                     f"--lora-modules {name}=...: {name!r} is the served model's name (give "
                     "the adapter another)")
            _require(Path(path, "adapter_config.json").is_file(),
                     f"--lora-modules {name}={path}: not a PEFT adapter directory "
                     "(no adapter_config.json)")
        _require(self.max_cpu_loras is None or self.max_loras is not None
                 and self.max_loras <= self.max_cpu_loras,
                 "--max-cpu-loras needs --max-loras at most as large (a batch's adapters must "
                 "all be loaded)")

    def check_disk_tier(self) -> None:
        """Raise ModelConfigError when --kv-disk-path cannot hold the disk tier: the directory
        must exist and take a file (a read-only or missing one is refused at start)."""
        if self.kv_disk_path is None:
            return
        path = Path(self.kv_disk_path)
        _require(path.is_dir(), f"--kv-disk-path {path}: no such directory")
        _require(self.enable_prefix_caching, "--kv-disk-path needs the prefix cache "
                                             "(--enable-prefix-caching)")
        try:
            with tempfile.NamedTemporaryFile(dir=path, prefix=".deepinfer-probe-"):
                pass
        except OSError as e:
            raise ModelConfigError(f"--kv-disk-path {path}: cannot write there ({e.strerror})"
                                   ) from None

    def disk_kv_blocks(self) -> int:
        """Blocks the disk tier holds: full-attention layers of every rank, like the host
        tier's."""
        full = self.kv_cache_layout().layers_of(FULL)
        if self.kv_disk_path is None or not full:
            return 0
        return max(1, int(self.kv_disk_gb * (1 << 30)) // self.kv_bytes_per_block(full))

    def check_parallel(self) -> None:
        """Raise ModelConfigError, naming the flag, when the model cannot be split as asked.

        Tensor parallelism shards the architectures the registry says it does
        (engine/model_registry.py: the Llama family and its MoE variants): KV heads
        split as evenly as their count allows, each with its query heads (or, with fewer KV
        heads than ranks, query heads split evenly and each rank's KV head replicated); the
        MLP's intermediate size and the vocabulary split evenly."""
        world = self.tensor_parallel_size
        _require(self.node_rank < self.nnodes,
                 f"--node-rank must be in [0, --nnodes), got {self.node_rank} of {self.nnodes}")
        _require(world % self.nnodes == 0,
                 f"--tensor-parallel-size {world} does not split over --nnodes {self.nnodes}")
        if self.nnodes > 1:
            self.dist_address()  # raises when there is none
            _require(envs.cluster_secret() is not None, _NEEDS_SECRET.format(
                what="--nnodes > 1", who="every node"))
        if world == 1:
            return
        model = self.model_config()
        flag = f"--tensor-parallel-size {world}"
        _require(self.speculative_method is None,
                 f"{flag}: speculative decoding over several ranks is not supported yet")
        if self.enable_expert_parallel:
            _require(model.num_experts > 0, f"--enable-expert-parallel: {model.architecture} "
                                            "has no experts")
            _require(model.num_experts % world == 0,
                     f"--enable-expert-parallel: the model's {model.num_experts} experts do not "
                     f"split over {world} ranks")
            return
        supported = tensor_parallel_architectures()
        _require(model.architecture in supported,
                 f"{flag}: tensor parallelism supports {', '.join(supported)}"
                 f" so far, not {model.architecture}"
                 + (" (--enable-expert-parallel splits its experts)" if model.num_experts else ""))
        kv = model.num_kv_heads
        split = [("intermediate size", model.intermediate_size),
                 ("vocabulary size", model.vocab_size)]
        if model.num_experts:
            split += [("expert intermediate size", model.moe_intermediate_size),
                      ("shared expert size", model.shared_expert_intermediate_size)]
        if kv < world:
            split.insert(0, ("attention heads", model.num_heads))
            _require(world % kv == 0, f"{flag}: the model's {kv} KV heads cannot be "
                                      f"replicated evenly over {world} ranks")
        for what, size in split:
            _require(size % world == 0, f"{flag}: the model's {what} ({size}) does not split "
                                        f"over {world} ranks")

    def dist_address(self) -> tuple[str, int] | None:
        """Multi-node rendezvous (host, port): --dist-init-addr, else MASTER_ADDR and
        MASTER_PORT; None on one node."""
        if self.nnodes == 1:
            return None
        addr = self.dist_init_addr or (
            f"{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '29500')}"
            if os.environ.get("MASTER_ADDR") else None)
        _require(addr is not None and ":" in addr,
                 "--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address), or "
                 "MASTER_ADDR and MASTER_PORT")
        host, _, port = addr.rpartition(":")
        _require(port.isdigit(), f"--dist-init-addr must be HOST:PORT, got {addr!r}")
        return host, int(port)

    def local_ranks(self) -> range:
        """The worker ranks this node runs."""
        per = self.tensor_parallel_size // self.nnodes
        return range(self.node_rank * per, (self.node_rank + 1) * per)

    def model_config(self) -> ModelConfig:
        """The model's config (parsed once per process); ModelConfigError if unusable."""
        return ModelConfig.from_dir(self.resolved_model_dir())

    def context_len(self) -> int:
        """The longest sequence (prompt + output) this engine serves: the model's context, capped
        by max_model_len and by what the KV cache holds, so a prompt that can never fit is
        refused up front (a 400) by every process alike."""
        model = self.model_config()
        model_len = min(self.max_model_len or model.max_position_embeddings,
                        model.max_position_embeddings)
        return min(model_len, self.kv_blocks() * self.block_size)

    def swa_replay_tokens(self) -> int | None:
        model = self.model_config()
        if model.sliding_window is None:
            return None
        if self.swa_replay == "exact" or self.deterministic:  # (window replay is approximate)
            return model.layer_kinds.count(SLIDING) * model.sliding_window
        return model.sliding_window

    def swa_snapshot_tokens(self) -> int:
        """Prompt tokens between two sliding-window snapshots (0: none inside prompts)."""
        window = self.model_config().sliding_window
        if window is None:
            return 0
        if self.swa_snapshot_interval is None:
            # At most W apart, so the window-mode budget always reaches the nearest one.
            return max(self.block_size, window // self.block_size * self.block_size)
        return self.swa_snapshot_interval

    def kv_cache_layout(self) -> KVCacheLayout:
        model = self.model_config()
        if model.compressed is not None:
            model.compressed.check_block_size(self.block_size)
        return model.kv_cache_layout(self.block_size)

    def kv_bytes_per_block(self, entries: list[int] | None = None) -> int:
        """Bytes of one block of these cache entries (default: all of them)."""
        layout = self.kv_cache_layout()
        return layout.bytes_per_token(_DTYPE_BYTES[self.kv_dtype()], entries) * self.block_size

    def host_kv_blocks(self) -> int:
        """Host-tier blocks: they hold full-attention layers only."""
        if self.host_kv_cache_gb <= 0:
            return 0
        full = self.kv_cache_layout().layers_of(FULL)
        if not full:
            return 0
        return max(1, int(self.host_kv_cache_gb * (1 << 30)) // self.kv_bytes_per_block(full))

    def kv_blocks(self) -> int:
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        return max(1, int(self.kv_cache_gb * (1 << 30)) // self.kv_bytes_per_block())

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> EngineConfig:
        return msgspec.msgpack.decode(data, type=cls)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ModelConfigError(message)
