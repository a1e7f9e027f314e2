"""Engine configuration: one msgspec Struct shared by every process.

The scheduler and the workers derive the same number of KV blocks from it (see `num_kv_blocks`),
so no process has to ask another how big the cache is.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from engine import envs

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


FULL = "full"
SLIDING = "sliding"


class ModelConfigError(ValueError):
    """The model cannot be served as asked (no such directory, no config.json, an unsupported
    architecture): the user's to fix, reported as one line, never a traceback."""


def layer_kinds(cfg: dict) -> list[str]:
    """Per-layer attention kind ("full" or "sliding") from an HF config.

    `layer_types` (Qwen3, GPT-OSS, Gemma 3 style) wins; otherwise a `sliding_window` applies to
    every layer (Mistral), unless `use_sliding_window` is false (Qwen2/Qwen3 defaults).
    """
    n = cfg["num_hidden_layers"]
    if cfg.get("layer_types"):
        return [SLIDING if "sliding" in t else FULL for t in cfg["layer_types"]]
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
        return [SLIDING] * n
    return [FULL] * n


class ModelInfo(msgspec.Struct, frozen=True):
    """What the engine needs to know about a checkpoint without importing torch."""

    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    layer_kinds: tuple[str, ...] = ()
    sliding_window: int | None = None

    def kv_groups(self) -> list[str]:
        """KV cache groups in a fixed order: full layers first, then sliding layers.

        Each group has its own block pool and its own block table per request: sliding layers
        only keep the blocks inside their window.
        """
        kinds = self.layer_kinds or (FULL,) * self.num_layers
        return [k for k in (FULL, SLIDING) if k in kinds]

    def layer_group(self, layer: int) -> int:
        kinds = self.layer_kinds or (FULL,) * self.num_layers
        return self.kv_groups().index(kinds[layer])

    def layers_in_group(self, group: int) -> int:
        kinds = self.layer_kinds or (FULL,) * self.num_layers
        return sum(1 for k in kinds if k == self.kv_groups()[group])

    @classmethod
    def from_dir(cls, model_dir: str) -> ModelInfo:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        eos = cfg.get("eos_token_id")
        gen_path = Path(model_dir) / "generation_config.json"
        if gen_path.exists():
            eos = json.loads(gen_path.read_text()).get("eos_token_id", eos)
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        kinds = tuple(layer_kinds(cfg))
        return cls(
            architecture=(cfg.get("architectures") or ["LlamaForCausalLM"])[0],
            num_layers=cfg["num_hidden_layers"],
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=head_dim,
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            eos_token_ids=eos_ids,
            layer_kinds=kinds,
            sliding_window=cfg.get("sliding_window") if SLIDING in kinds else None,
        )


class EngineConfig(msgspec.Struct, kw_only=True):
    model: str = "default"
    served_model_name: str | None = None
    dtype: str = "float32"
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
    enable_prefix_caching: bool = True
    # Host-memory tier for blocks evicted from the prefix cache (0: off).
    host_kv_cache_gb: float = 0.0
    # After a prefix hit, sliding-window layers rebuild their window by replaying tokens:
    # "window" replays W tokens (bounded, approximate beyond the first sliding layer);
    # "exact" replays sliding_layers * W tokens (identical to a cold run).
    swa_replay: str = "window"
    # Plan step N+1 while the workers compute step N (see engine/scheduler_process.py).
    overlap_scheduling: bool = True
    seed: int = 0
    worker_threads: int | None = None

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

    def model_info(self) -> ModelInfo:
        return ModelInfo.from_dir(self.resolved_model_dir())

    def context_len(self) -> int:
        """The longest sequence (prompt + output) this engine serves: the model's context, capped
        by max_model_len and by what the KV cache holds, so a prompt that can never fit is
        refused up front (a 400) by every process alike."""
        info = self.model_info()
        model_len = min(self.max_model_len or info.max_position_embeddings,
                        info.max_position_embeddings)
        return min(model_len, self.kv_blocks() * self.block_size)

    def swa_replay_tokens(self) -> int | None:
        info = self.model_info()
        if info.sliding_window is None:
            return None
        if self.swa_replay == "exact":
            return info.layers_in_group(info.kv_groups().index(SLIDING)) * info.sliding_window
        if self.swa_replay != "window":
            raise ValueError(f"swa_replay must be 'window' or 'exact', not {self.swa_replay!r}")
        return info.sliding_window

    def kv_bytes_per_block(self, num_layers: int | None = None) -> int:
        """Bytes of K and V for one block of `num_layers` layers (default: all of them)."""
        info = self.model_info()
        layers = info.num_layers if num_layers is None else num_layers
        per_token = 2 * layers * info.num_kv_heads * info.head_dim
        return per_token * self.block_size * _DTYPE_BYTES[self.dtype]

    def host_kv_blocks(self) -> int:
        """Host-tier blocks: they hold full-attention layers only."""
        if self.host_kv_cache_gb <= 0:
            return 0
        info = self.model_info()
        full_layers = info.layers_in_group(0) if info.kv_groups()[0] == FULL else 0
        if not full_layers:
            return 0
        return max(1, int(self.host_kv_cache_gb * (1 << 30))
                   // self.kv_bytes_per_block(full_layers))

    def kv_blocks(self) -> int:
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        return max(1, int(self.kv_cache_gb * (1 << 30)) // self.kv_bytes_per_block())

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> EngineConfig:
        return msgspec.msgpack.decode(data, type=cls)
