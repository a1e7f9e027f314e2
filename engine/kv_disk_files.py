"""The disk tier's files: one per block and rank, named by the block's chained digest, so any
server of the same model (same identity key, engine/kvcache/block_identity.py) finds it.

    DIR/<identity>/rank<R>/<digest[:2]>/<digest>.kv

A file is a header, then the block's bytes (every full-attention K and V row of the rank, in
the worker's order). The header carries the rank's identity key, the digest and a checksum of
the payload: a damaged, truncated or foreign file fails `check` and is never used. Files are
written under a temporary name beside their final one and renamed into place (atomic on
POSIX): a reader sees the whole file or none, a crash leaves a temporary file (swept at start),
and two servers writing one block leave either one of two equal files.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from deepinfer.engine.model_config import FULL, SLIDING

if TYPE_CHECKING:
    from deepinfer.engine.config import EngineConfig

MAGIC = b"DIKVBLK1"
# magic, rank identity, digest, payload bytes, CRC-32 of the payload (it finds damage; what
# guards against a foreign file is the key, the directory's permissions against a hostile one)
_HEADER = struct.Struct("<8s32s32sQI")
HEADER_BYTES = _HEADER.size
SUFFIX, TEMP_PREFIX = ".kv", "."
STALE_TEMP_SECONDS = 600.0  # a temporary file this old belongs to a writer that died


def block_payloads(cfg: EngineConfig) -> tuple[int, int]:
    """What the worker halves (workers/kv_connectors/disk_tier.py) write per block over every
    rank: (a full-attention block's payload, a proposer's rows included; one sliding-window
    block's share of a snapshot)."""
    layout = cfg.kv_cache_layout()
    full, sliding = layout.layers_of(FULL), layout.layers_of(SLIDING)
    full_bytes = cfg.kv_bytes_per_block(full) if full else 0
    if cfg.speculative_method == "draft" and cfg.speculative_model:
        draft = msgspec.structs.replace(cfg, model=cfg.speculative_model,
                                        speculative_method=None, speculative_model=None)
        full_bytes += draft.kv_bytes_per_block()  # every layer full (checked at its load)
    elif cfg.speculative_method == "mtp":  # one layer shaped as the first, in --dtype
        full_bytes += msgspec.structs.replace(cfg, kv_cache_dtype="auto").kv_bytes_per_block([0])
    elif cfg.speculative_method == "dspark" and cfg.speculative_model:
        full_bytes += dspark_bytes_per_block(cfg)
    return full_bytes, cfg.kv_bytes_per_block(sliding) if sliding else 0


def dspark_bytes_per_block(cfg: EngineConfig) -> int:
    """A DSpark drafter's K and V of every draft layer, in --dtype (its config.json)."""
    raw = json.loads((Path(cfg.speculative_model) / "config.json").read_text())
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    per_token = 2 * raw["num_hidden_layers"] * (raw.get("num_key_value_heads") or heads) * head_dim
    return per_token * cfg.block_size * {"float32": 4, "float16": 2, "bfloat16": 2}[cfg.dtype]


class DamagedBlock(Exception):
    """A block file that must not be used (it is deleted and the block recomputed)."""


class NotABlockFile(OSError):
    """Something else at a block's path (a FIFO, a device, a directory): not read, not
    deleted (it is no file of ours), the block recomputed."""


def tier_dir(root: str | os.PathLike, identity: bytes) -> Path:
    """The server's folder under --kv-disk-path: one per identity key."""
    return Path(root) / identity.hex()[:32]


def rank_dir(root: str | os.PathLike, identity: bytes, rank: int) -> Path:
    return tier_dir(root, identity) / f"rank{rank}"


def block_path(folder: Path, digest: bytes) -> Path:
    name = digest.hex()
    return folder / name[:2] / f"{name}{SUFFIX}"


def checksum(payload) -> int:
    return zlib.crc32(payload)


def encode_header(identity: bytes, digest: bytes, payload) -> bytes:
    return _HEADER.pack(MAGIC, identity, digest, len(payload), checksum(payload))


def write_block(folder: Path, digest: bytes, identity: bytes, payload) -> int:
    """Write one block atomically; returns the bytes written. Raises OSError (a full disk)."""
    path = block_path(folder, digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.parent / f"{TEMP_PREFIX}{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        # Owner-only: a block's bytes say what prompts were served.
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with open(fd, "wb") as f:
            f.write(encode_header(identity, digest, payload))
            f.write(payload)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return HEADER_BYTES + len(payload)


def read_block(folder: Path, digest: bytes, identity: bytes, payload_bytes: int) -> bytes:
    """The payload of a block's file, checked. Raises FileNotFoundError (gone: another server
    evicted it), NotABlockFile or DamagedBlock."""
    # Non-blocking open: a FIFO at the path would block until a writer came; only a regular
    # file is read (a link is not followed out of the folder).
    fd = os.open(block_path(folder, digest), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotABlockFile("not a regular file")
        data = f.read(HEADER_BYTES + payload_bytes + 1)
    return check(data, digest, identity, payload_bytes)


def check(data: bytes, digest: bytes, identity: bytes, payload_bytes: int) -> bytes:
    if len(data) != HEADER_BYTES + payload_bytes:
        raise DamagedBlock(f"{len(data)} bytes, {HEADER_BYTES + payload_bytes} expected")
    magic, ident, name, size, summed = _HEADER.unpack_from(data)
    payload = data[HEADER_BYTES:]
    if magic != MAGIC or size != payload_bytes:
        raise DamagedBlock("not a block file of this format")
    if ident != identity or name != digest:
        raise DamagedBlock("a block of another model, rank or prefix")
    if checksum(payload) != summed:
        raise DamagedBlock("checksum mismatch")
    return payload


def delete_block(folder: Path, digest: bytes) -> None:
    block_path(folder, digest).unlink(missing_ok=True)


def scan(folder: Path, now: float | None = None) -> Iterator[tuple[bytes, float, int]]:
    """(digest, last modified, size) of every block file in a rank folder; stale temporary
    files (a writer that died mid-write) are deleted on the way."""
    now = time.time() if now is None else now
    if not folder.is_dir():
        return
    for sub in folder.iterdir():
        if not sub.is_dir():
            continue
        for entry in os.scandir(sub):
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # another server removed it meanwhile
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            mtime = st.st_mtime
            if entry.name.startswith(TEMP_PREFIX):
                if now - mtime > STALE_TEMP_SECONDS:
                    Path(entry.path).unlink(missing_ok=True)
                continue
            stem = entry.name.removesuffix(SUFFIX)
            if entry.name.endswith(SUFFIX) and len(stem) == 64:
                try:
                    yield bytes.fromhex(stem), mtime, st.st_size
                except ValueError:
                    continue
