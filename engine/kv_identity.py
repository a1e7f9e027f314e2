"""What, besides its tokens, decides a server's KV blocks: the identity key every block digest
chains in (engine/kvcache/block_hash.py), and each rank's own key (the disk tier's files).
Torch-free and outside engine/kvcache: the workers name their files with it too. Two servers
share blocks (through KV events or the disk tier's shared directory) only when their keys are
equal, so the key names the model by its content, not by where it lies: a fine-tune in a
directory of the same name is another model."""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from deepinfer.engine.config import EngineConfig

# Bytes sampled from each weight file, at evenly spaced offsets: enough that two checkpoints of
# one architecture (a fine-tune, another seed) differ in them, few enough to read at start.
_SAMPLES, _SAMPLE_BYTES = 32, 4096
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")


def identity_key(model: str, dtype: str, kv_cache_dtype: str, block_size: int,
                 layout: str = "") -> bytes:
    """What, besides the tokens, decides a block's KV (`layout`: e.g. the TP rank layout)."""
    fields = ["deepinfer-kv-block-v1", model, dtype, kv_cache_dtype, block_size, layout]
    return hashlib.sha256(msgspec.msgpack.encode(fields)).digest()



@functools.lru_cache(maxsize=8)
def model_fingerprint(model_dir: str) -> str:
    """A digest of the model's config and of samples of its weights (hex)."""
    h = hashlib.sha256()
    root = Path(model_dir)
    for path in sorted(p for p in root.iterdir() if p.is_file()):
        if path.name == "config.json":
            h.update(b"config\0" + path.read_bytes())
        elif path.suffix in _WEIGHT_SUFFIXES:
            size = path.stat().st_size
            h.update(f"{path.name}\0{size}\0".encode())
            with open(path, "rb") as f:
                for i in range(_SAMPLES):
                    f.seek(size * i // _SAMPLES)
                    h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def adapter_salt(name: str, path: str) -> int:
    """A LoRA adapter's salt in the prefix cache's ids (kv_manager.cache_tokens), from its name
    and its files' content: the same name over other weights (after a restart, in a shared
    disk tier) is another adapter. Non-zero, below 2^31."""
    h = hashlib.sha256(b"deepinfer-lora\0" + name.encode() + b"\0")
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        h.update(Path(path, file).read_bytes())
    return int.from_bytes(h.digest()[:4], "big") % (2**31 - 1) + 1


def kv_block_identity(cfg: EngineConfig) -> bytes:
    """This server's key: the model (its content and architecture), dtypes, block size and
    tensor-parallel layout."""
    model_dir = cfg.resolved_model_dir()
    model = f"{model_fingerprint(os.path.realpath(model_dir))}:{cfg.model_config().architecture}"
    return identity_key(model, cfg.dtype, cfg.kv_dtype(), cfg.block_size,
                        f"tp{cfg.tensor_parallel_size}")


def rank_identity(identity: bytes, rank: int) -> bytes:
    """One rank's share of a block (tensor parallelism splits the KV heads): its own key."""
    return hashlib.sha256(identity + b"\0rank" + rank.to_bytes(4, "little")).digest()
