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

import os
import struct
import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path

MAGIC = b"DIKVBLK1"
# magic, rank identity, digest, payload bytes, CRC-32 of the payload (it finds damage; what
# guards against a foreign file is the key, the directory's permissions against a hostile one)
_HEADER = struct.Struct("<8s32s32sQI")
HEADER_BYTES = _HEADER.size
SUFFIX, TEMP_PREFIX = ".kv", "."
STALE_TEMP_SECONDS = 600.0  # a temporary file this old belongs to a writer that died


class DamagedBlock(Exception):
    """A block file that must not be used (it is deleted and the block recomputed)."""


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
        with open(temp, "wb") as f:
            f.write(encode_header(identity, digest, payload))
            f.write(payload)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return HEADER_BYTES + len(payload)


def read_block(folder: Path, digest: bytes, identity: bytes, payload_bytes: int) -> bytes:
    """The payload of a block's file, checked. Raises FileNotFoundError (gone: another server
    evicted it) or DamagedBlock."""
    with open(block_path(folder, digest), "rb") as f:
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


def scan(folder: Path, now: float | None = None) -> Iterator[tuple[bytes, float]]:
    """(digest, last modified) of every block file in a rank folder; stale temporary files
    (a writer that died mid-write) are deleted on the way."""
    now = time.time() if now is None else now
    if not folder.is_dir():
        return
    for sub in folder.iterdir():
        if not sub.is_dir():
            continue
        for entry in os.scandir(sub):
            try:
                mtime = entry.stat().st_mtime
            except FileNotFoundError:  # another server removed it meanwhile
                continue
            if entry.name.startswith(TEMP_PREFIX):
                if now - mtime > STALE_TEMP_SECONDS:
                    Path(entry.path).unlink(missing_ok=True)
                continue
            stem = entry.name.removesuffix(SUFFIX)
            if entry.name.endswith(SUFFIX) and len(stem) == 64:
                try:
                    yield bytes.fromhex(stem), mtime
                except ValueError:
                    continue
