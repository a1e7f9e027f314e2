"""The identity of a KV block: a chained content digest, defined once for every tier and server.

A block's digest is sha256 over its parent's digest (the block before it in the sequence), its
token ids and an identity key for everything else that changes its KV (the model, its dtype and
the KV cache's, the block size, the rank layout). Two servers of the same model and settings
give the same prompt the same digests, so a router or a shared tier (KV events, the disk tier of
issue 42) can find a block wherever it is; a different model or layout can never collide.

KV events report the digest as a 64-bit int (its first 8 bytes, big-endian, unsigned: msgpack's
uint64, what vLLM's consumers take); tiers that store blocks keep the full 32 bytes.
"""

from __future__ import annotations

import hashlib

import msgspec
import numpy as np

DIGEST_BYTES = 32


def identity_key(model: str, dtype: str, kv_cache_dtype: str, block_size: int,
                 layout: str = "") -> bytes:
    """What, besides the tokens, decides a block's KV (`layout`: e.g. the TP rank layout)."""
    fields = ["deepinfer-kv-block-v1", model, dtype, kv_cache_dtype, block_size, layout]
    return hashlib.sha256(msgspec.msgpack.encode(fields)).digest()


def block_digest(parent: bytes | None, tokens, identity: bytes) -> bytes:
    """The digest of one block: `parent` is the previous block's digest (None for the first)."""
    h = hashlib.sha256(identity)
    h.update(parent if parent is not None else bytes(DIGEST_BYTES))
    h.update(np.asarray(tokens, dtype="<i4").tobytes())  # fixed width: no ambiguous joins
    return h.digest()


def chain(tokens, block_size: int, identity: bytes, parent: bytes | None = None
          ) -> list[bytes]:
    """Digests of every full block of `tokens`, continuing after `parent`."""
    out = []
    flat = np.asarray(tokens, dtype="<i4")
    for i in range(len(flat) // block_size):
        parent = block_digest(parent, flat[i * block_size:(i + 1) * block_size], identity)
        out.append(parent)
    return out


def external_hash(digest: bytes) -> int:
    """The 64-bit form KV events carry (fits msgpack's uint64)."""
    return int.from_bytes(digest[:8], "big", signed=False)
