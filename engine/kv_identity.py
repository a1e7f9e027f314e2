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

from deepinfer.engine import envs
from deepinfer.engine.model_store.gguf_model import gguf_source

if TYPE_CHECKING:
    from deepinfer.engine.config import EngineConfig

_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")
_DIGEST_CACHE = "kv-identity"  # DEEPINFER_CACHE/kv-identity/: one weight file's digest each


def identity_key(model: str, dtype: str, kv_cache_dtype: str, block_size: int,
                 layout: str = "") -> bytes:
    """What, besides the tokens, decides a block's KV (`layout`: e.g. the TP rank layout)."""
    fields = ["deepinfer-kv-block-v1", model, dtype, kv_cache_dtype, block_size, layout]
    return hashlib.sha256(msgspec.msgpack.encode(fields)).digest()



def file_digest(path: Path) -> str:
    """SHA-256 of every byte of a file (hex): read once, then kept in DEEPINFER_CACHE under its
    real path, size and modification time (a replaced or rewritten file is read again)."""
    real = Path(os.path.realpath(path))
    st = real.stat()
    key = hashlib.sha256(f"{real}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()
    memo = envs.cache_dir() / _DIGEST_CACHE / key[:32]
    try:
        known = memo.read_text()
        if len(known) == 64:
            return known
    except OSError:
        pass
    with open(real, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    try:  # written whole or not at all (several processes of one server compute it at once)
        memo.parent.mkdir(parents=True, exist_ok=True)
        temp = memo.with_name(f".{memo.name}.{os.getpid()}")
        temp.write_text(digest)
        os.replace(temp, memo)
    except OSError:  # a read-only cache: read the file again next time
        pass
    return digest


@functools.lru_cache(maxsize=8)
def model_fingerprint(model_dir: str) -> str:
    """A digest of the model's config and of every byte of its weights (hex); a GGUF served
    through its sidecar directory (engine/model_store/gguf_model.py) counts its file's."""
    h = hashlib.sha256()
    root = Path(model_dir)
    for path in sorted(p for p in root.iterdir() if p.is_file()):
        if path.name == "config.json":
            h.update(b"config\0" + path.read_bytes())
        elif path.suffix in _WEIGHT_SUFFIXES:
            h.update(f"{path.name}\0{file_digest(path)}\0".encode())
    source = gguf_source(root)
    if source is not None:
        h.update(f"gguf\0{file_digest(source)}\0".encode())
    return h.hexdigest()


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def adapter_digest(config: bytes, weights: bytes) -> str:
    """The digest of a LoRA adapter's two files' bytes (hex): what the workers served and what
    the prefix cache's salt names must be the same bytes."""
    return hashlib.sha256(config + b"\0" + weights).hexdigest()


def adapter_salt(name: str, digest: str) -> int:
    """A LoRA adapter's salt in the prefix cache's ids (kv_manager.cache_tokens), from its name
    and its files' digest: the same name over other weights (after a restart, in a shared disk
    tier) is another adapter. Non-zero, below 2^31."""
    h = hashlib.sha256(b"deepinfer-lora\0" + name.encode() + b"\0" + digest.encode())
    return int.from_bytes(h.digest()[:4], "big") % (2**31 - 1) + 1


def adapter_salt_at(name: str, path: str) -> int:
    """`adapter_salt` of the adapter whose files are at `path` (read now)."""
    config, weights = (Path(path, file).read_bytes() for file in ADAPTER_FILES)
    return adapter_salt(name, adapter_digest(config, weights))


def request_salt(adapter: int, cache_salt: str | None) -> int:
    """A request's salt in the prefix cache's ids: its LoRA adapter's (`adapter`, 0: none),
    mixed with the client's cache_salt when it sends one. Non-zero then, below 2^31."""
    if cache_salt is None:
        return adapter
    h = hashlib.sha256(b"deepinfer-cache-salt\0" + adapter.to_bytes(4, "little")
                       + cache_salt.encode())
    return int.from_bytes(h.digest()[:4], "big") % (2**31 - 1) + 1


def kv_block_identity(cfg: EngineConfig) -> bytes:
    """This server's key: everything that changes the bytes of its blocks: the model (every
    weight byte and its architecture), how its weights are quantized, dtypes, block size,
    tensor-parallel layout, the sliding-window replay mode (a hit's later blocks differ between
    window and exact replay) and a proposer's rows (a draft model's or MTP's KV, saved beside
    the target's)."""
    info = cfg.model_config()
    model = f"{model_fingerprint(os.path.realpath(cfg.resolved_model_dir()))}:{info.architecture}"
    quant = cfg.quantization or "checkpoint"
    if quant == "int8" and envs.int8_dynamic_activations():
        quant += "+dynamic-activations"
    model += f":quant={quant}"
    if info.sliding_window is not None:
        model += f":swa-replay={cfg.swa_replay}"
    if cfg.speculative_method == "mtp":
        model += ":mtp"
    elif cfg.speculative_method == "draft" and cfg.speculative_model:
        draft = msgspec.structs.replace(cfg, model=cfg.speculative_model).resolved_model_dir()
        model += f":draft={model_fingerprint(os.path.realpath(draft))}"
    elif cfg.speculative_method == "dspark" and cfg.speculative_model:
        model += f":dspark={model_fingerprint(os.path.realpath(cfg.speculative_model))}"
    return identity_key(model, cfg.dtype, cfg.kv_dtype(), cfg.block_size,
                        f"tp{cfg.tensor_parallel_size}")


def rank_identity(identity: bytes, rank: int) -> bytes:
    """One rank's share of a block (tensor parallelism splits the KV heads): its own key."""
    return hashlib.sha256(identity + b"\0rank" + rank.to_bytes(4, "little")).digest()
