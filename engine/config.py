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


class ModelInfo(msgspec.Struct, frozen=True):
    """What the engine needs to know about a checkpoint without importing torch."""

    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]

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
        return cls(
            architecture=(cfg.get("architectures") or ["LlamaForCausalLM"])[0],
            num_layers=cfg["num_hidden_layers"],
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=head_dim,
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            eos_token_ids=eos_ids,
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
    max_num_batched_tokens: int = 1024
    # Longest prefill chunk one request may take in a step (chunked prefill).
    prefill_chunk_size: int = 512
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
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
        info = self.model_info()
        return min(self.max_model_len or info.max_position_embeddings, info.max_position_embeddings)

    def kv_bytes_per_block(self) -> int:
        info = self.model_info()
        per_token = 2 * info.num_layers * info.num_kv_heads * info.head_dim
        return per_token * self.block_size * _DTYPE_BYTES[self.dtype]

    def kv_blocks(self) -> int:
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        return max(1, int(self.kv_cache_gb * (1 << 30)) // self.kv_bytes_per_block())

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> EngineConfig:
        return msgspec.msgpack.decode(data, type=cls)
