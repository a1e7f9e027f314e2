"""Engine configuration: one msgspec Struct shared by every process.

The scheduler and the workers derive the same number of KV blocks from it (see `num_kv_blocks`),
so no process has to ask another how big the cache is. The model's own config is the typed
ModelConfig of engine/model_config.py.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import msgspec

from deepinfer.engine import envs
from deepinfer.engine.kv_layout import KV, KVCacheLayout
from deepinfer.engine.model_config import FULL, SLIDING, ModelConfig, ModelConfigError

__all__ = ["EngineConfig", "ModelConfig", "ModelConfigError", "FULL", "SLIDING",
           "DEFAULT_MODEL_NAME", "SPECULATIVE_METHODS", "MAX_SPECULATIVE_TOKENS",
           "DISAGGREGATION_MODES", "KV_TRANSFER_BACKENDS", "QUANTIZATIONS", "DEVICES",
           "KV_CACHE_DTYPES"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SPECULATIVE_METHODS = ("ngram", "draft", "mtp")
DISAGGREGATION_MODES = ("none", "prefill", "decode")
KV_TRANSFER_BACKENDS = ("zmq", "nixl")
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
TENSOR_PARALLEL_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                 "Qwen3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
                                 "Qwen3MoeForCausalLM")
# More drafts than this are almost never accepted and make every verify step wider.
MAX_SPECULATIVE_TOKENS = 16
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class EngineConfig(msgspec.Struct, kw_only=True):
    model: str = "default"
    served_model_name: str | None = None
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES
    block_size: int = 16
    # KV cache size: an explicit block count wins over a memory budget.
    num_kv_blocks: int | None = None
    kv_cache_gb: float = 1.0
    max_num_seqs: int = 64
    # 256 keeps ITL p99 under 3x its median at 64 concurrent requests on 2 cores (BENCHMARKS.md).
    max_num_batched_tokens: int = 256
    # Longest prefill chunk one request may take in a step (chunked prefill).
    prefill_chunk_size: int = 512
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    # Multi-node: the worker ranks spread evenly over `nnodes` hosts; node 0 runs the API
    # server, tokenizer and scheduler too. `dist_init_addr` (HOST:PORT on node 0, or
    # MASTER_ADDR / MASTER_PORT) is the torch.distributed rendezvous; the scheduler's plans
    # to the ranks go to the ports after it.
    # With several ranks: each holds whole experts of every MoE layer (tokens reach them
    # through one all-reduce) and the dense layers replicated, instead of tensor parallelism.
    enable_expert_parallel: bool = False
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    enable_prefix_caching: bool = True
    # Host-memory tier for blocks evicted from the prefix cache (0: off).
    host_kv_cache_gb: float = 0.0
    # After a prefix hit, sliding-window layers rebuild their window by replaying tokens:
    # "window" replays W tokens (bounded, approximate beyond the first sliding layer);
    # "exact" replays sliding_layers * W tokens (identical to a cold run).
    swa_replay: str = "window"
    # Sliding-window snapshots inside long prompts, every this many tokens (rounded down to a
    # block): a hit between two replays from the nearest one. None: every window W (then a hit
    # along a cached prompt always finds one within W, and replays from it exactly); 0: only at
    # the ends of prompts and requests.
    swa_snapshot_interval: int | None = None
    # Plan step N+1 while the workers compute step N (see engine/scheduler_process.py).
    overlap_scheduling: bool = True
    seed: int = 0
    device: str = "auto"  # DEVICES
    # GPU: no CUDA graphs (every decode step launches its kernels one by one).
    enforce_eager: bool = False
    worker_threads: int | None = None
    # Copies of each linear weight on CPU: both (fastest at every batch size, 2x memory),
    # packed (oneDNN only), plain (small-M kernel, F.linear above 4 rows), auto (both while
    # the second copy costs at most an eighth of RAM). int8 / 4-bit weights: the integer
    # GEMM's repacked copy is the second one (kept with both).
    cpu_linear_weights: str = "auto"
    # Linear weights (QUANTIZATIONS); None: as the checkpoint has them (an fp8 checkpoint's
    # config says so, a GGUF's tensors keep their types, anything else stays float).
    quantization: str | None = None
    # Speculative decoding: None (off), "ngram" (prompt lookup), "draft" (a smaller model with
    # the same tokenizer, --speculative-model) or "mtp" (the model's own multi-token heads).
    speculative_method: str | None = None
    num_speculative_tokens: int = 3  # drafts per step (3: a batch-1 verify is 4 rows)
    speculative_model: str | None = None
    ngram_min: int = 2  # shortest suffix n-gram looked up in the request's own tokens
    ngram_max: int = 4
    # No speculation in a step with more running requests than this (None: no limit).
    speculative_disable_by_batch_size: int | None = None
    # Structured output: a grammar that takes longer to compile is refused (a 400), and so is
    # one whose text (schema, regex, EBNF, choices) is longer than this many bytes.
    grammar_compile_timeout: float = 20.0
    grammar_max_bytes: int = 65536
    # Prefill/decode disaggregation (engine/kvcache/transfer.py): "prefill" serves the KV of
    # finished prompts to decode servers, "decode" pulls it; either still serves ordinary
    # requests. The workers' transfer sockets bind on kv_transfer_host (reachable by peers).
    disaggregation_mode: str = "none"
    kv_transfer_host: str = "127.0.0.1"
    # Decode: a pull that gets no answer for this long fails its request. Prefill: blocks no
    # decode server pulled are freed after kv_hold_timeout.
    kv_transfer_timeout: float = 30.0
    kv_hold_timeout: float = 120.0
    # How KV blocks move between servers: "zmq" (over the transfer sockets themselves, works
    # anywhere) or "nixl" (NIXL READs, workers/kv_connectors/transfer/nixl_transport.py; an extra).
    kv_transfer_backend: str = "zmq"

    def resolved_model_dir(self) -> str:
        if self.model in ("default", DEFAULT_MODEL_NAME):
            return str(envs.cache_dir() / DEFAULT_MODEL_NAME)
        return self.model

    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model in ("default", DEFAULT_MODEL_NAME):
            return DEFAULT_MODEL_NAME
        return Path(self.model).name

    def check_speculative(self) -> None:
        """Raise ModelConfigError, naming the flag, if the speculative settings cannot work.

        Values only (no files are read), so a typo is reported before a model is prepared; the
        draft model's directory is checked by engine.model_store.ensure_config."""
        method = self.speculative_method
        _require(method is None or method in SPECULATIVE_METHODS,
                 f"--speculative-method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                 f"not {method!r}")
        k = self.num_speculative_tokens
        _require(method is None or 1 <= k <= MAX_SPECULATIVE_TOKENS,
                 f"--num-speculative-tokens must be between 1 and {MAX_SPECULATIVE_TOKENS}, "
                 f"got {k}")
        _require(self.ngram_min >= 1, f"--ngram-min must be at least 1, got {self.ngram_min}")
        _require(self.ngram_min <= self.ngram_max,
                 f"--ngram-min ({self.ngram_min}) must not exceed --ngram-max ({self.ngram_max})")
        _require(method != "draft" or bool(self.speculative_model),
                 "--speculative-method draft needs --speculative-model (the draft model's "
                 "directory)")
        _require(method == "draft" or self.speculative_model is None,
                 "--speculative-model is only used with --speculative-method draft")
        limit = self.speculative_disable_by_batch_size
        _require(limit is None or limit >= 1,
                 f"--speculative-disable-by-batch-size must be at least 1, got {limit}")

    def check_structured(self) -> None:
        """Raise ModelConfigError, naming the flag, for unusable structured-output limits."""
        timeout = self.grammar_compile_timeout
        _require(timeout > 0, f"--grammar-compile-timeout must be positive, got {timeout:g}")
        _require(self.grammar_max_bytes >= 1,
                 f"--grammar-max-bytes must be at least 1, got {self.grammar_max_bytes}")

    def check_quantization(self) -> None:
        _require(self.quantization is None or self.quantization in QUANTIZATIONS,
                 f"--quantization must be one of {', '.join(QUANTIZATIONS)}, "
                 f"not {self.quantization!r}")
        _require(self.quantization in (None, "none") or self.dtype == "float32",
                 f"--quantization {self.quantization} computes in float32 (not --dtype "
                 f"{self.dtype})")

    def kv_dtype(self) -> str:
        """The KV cache's element type: --kv-cache-dtype, or --dtype under auto
        (ModelConfigError, naming the flag, for a value that is neither)."""
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES,
                 f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                 f"not {self.kv_cache_dtype!r}")
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
        _require(self.device in DEVICES,
                 f"--device must be one of {', '.join(DEVICES)}, not {self.device!r}")
        if self.device == "cuda":
            for problem in self.cpu_only_features():
                raise ModelConfigError(f"--device cuda: {problem}")

    def cpu_only_features(self) -> list[str]:
        """The settings that run on CPU workers only so far, each as a sentence."""
        out = []
        if self.quantization in ("int8", "fp8"):
            out.append(f"--quantization {self.quantization} runs on CPU workers only so far")
        if self.speculative_method in ("draft", "mtp"):
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
        _require(self.disaggregation_mode in DISAGGREGATION_MODES,
                 f"--disaggregation-mode must be one of {', '.join(DISAGGREGATION_MODES)}, "
                 f"not {self.disaggregation_mode!r}")
        for flag, value in (("--kv-transfer-timeout", self.kv_transfer_timeout),
                            ("--kv-hold-timeout", self.kv_hold_timeout)):
            _require(value > 0, f"{flag} must be positive, got {value:g}")
        _require(self.kv_transfer_backend in KV_TRANSFER_BACKENDS,
                 f"--kv-transfer-backend must be one of {', '.join(KV_TRANSFER_BACKENDS)}, "
                 f"not {self.kv_transfer_backend!r}")
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

    def check_parallel(self) -> None:
        """Raise ModelConfigError, naming the flag, when the model cannot be split as asked.

        Tensor parallelism shards the Llama family (Llama, Mistral, Qwen2, Qwen3): KV heads
        split as evenly as their count allows, each with its query heads (or, with fewer KV
        heads than ranks, query heads split evenly and each rank's KV head replicated); the
        MLP's intermediate size and the vocabulary split evenly."""
        world = self.tensor_parallel_size
        _require(world >= 1, f"--tensor-parallel-size must be at least 1, got {world}")
        _require(self.nnodes >= 1 and 0 <= self.node_rank < self.nnodes,
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
        _require(model.architecture in TENSOR_PARALLEL_ARCHITECTURES,
                 f"{flag}: tensor parallelism supports {', '.join(TENSOR_PARALLEL_ARCHITECTURES)}"
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
        if self.swa_replay == "exact":
            return model.layer_kinds.count(SLIDING) * model.sliding_window
        if self.swa_replay != "window":
            raise ValueError(f"swa_replay must be 'window' or 'exact', not {self.swa_replay!r}")
        return model.sliding_window

    def swa_snapshot_tokens(self) -> int:
        """Prompt tokens between two sliding-window snapshots (0: none inside prompts)."""
        window = self.model_config().sliding_window
        if window is None:
            return 0
        if self.swa_snapshot_interval is None:
            # At most W apart, so the window-mode budget always reaches the nearest one.
            return max(self.block_size, window // self.block_size * self.block_size)
        if self.swa_snapshot_interval < 0:
            raise ValueError("swa_snapshot_interval must be >= 0")
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
