"""The identity of a KV block: a chained content digest, defined once for every tier and server.

A block's digest is sha256 over its parent's digest (the block before it in the sequence), its
token ids (a LoRA adapter's salted: `token_bytes`) and an identity key for everything else that
changes its KV (the model, its dtype and the KV cache's, the block size, the rank layout:
engine/kv_identity.py). Two servers of the same model and settings give the same prompt the same
digests, so a router or a shared tier (KV events, the disk tier) can find a block wherever it
is; a different model, layout or adapter can never collide.

KV events report the digest as a 64-bit int (its first 8 bytes, big-endian, unsigned: msgpack's
uint64, what vLLM's consumers take); tiers that store blocks keep the full 32 bytes."""

from __future__ import annotations

import hashlib

import numpy as np

DIGEST_BYTES = 32


def token_bytes(tokens) -> bytes:
    """Cache-key ids as bytes, fixed width (no ambiguous joins): int32 each, or int64 each when
    some id is beyond int32 (a LoRA adapter's ids carry its salt above bit 32: kv_manager's
    cache_tokens), so an adapter's blocks never share an identity with the base model's."""
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.size and (ids.max() > np.iinfo(np.int32).max or ids.min() < np.iinfo(np.int32).min):
        return ids.astype("<i8").tobytes()
    return ids.astype("<i4").tobytes()


def block_digest(parent: bytes | None, tokens, identity: bytes) -> bytes:
    """The digest of one block: `parent` is the previous block's digest (None for the first)."""
    h = hashlib.sha256(identity)
    h.update(parent if parent is not None else bytes(DIGEST_BYTES))
    h.update(token_bytes(tokens))
    return h.digest()


def chain(tokens, block_size: int, identity: bytes, parent: bytes | None = None
          ) -> list[bytes]:
    """Digests of every full block of `tokens`, continuing after `parent`."""
    out = []
    flat = np.asarray(tokens, dtype=np.int64)
    for i in range(len(flat) // block_size):
        parent = block_digest(parent, flat[i * block_size:(i + 1) * block_size], identity)
        out.append(parent)
    return out


def snapshot_digest(digest: bytes) -> bytes:
    """The name of the sliding-window snapshot kept where the block `digest` ends."""
    return hashlib.sha256(b"deepinfer-swa-snapshot\0" + digest).digest()


def external_hash(digest: bytes) -> int:
    """The 64-bit form KV events carry (fits msgpack's uint64)."""
    return int.from_bytes(digest[:8], "big", signed=False)


class BlockDigests:
    """(digest, parent digest) of each device block while it is in the prefix cache, chained
    on as blocks enter it: what the KV events and the disk tier name blocks by."""

    def __init__(self, identity: bytes, block_size: int) -> None:
        self.identity = identity
        self.block_size = block_size
        self._blocks: dict[int, tuple[bytes, bytes | None]] = {}

    def stored(self, parent_block: int | None, tokens, blocks: list[int]
               ) -> tuple[bytes | None, list[bytes]] | None:
        """`blocks` (holding `tokens`, block after block) entered the cache after the cached
        block `parent_block` (None: they start the sequence). Returns (parent digest, their
        digests); None when the parent was never reported (no chain to extend)."""
        parent = None
        if parent_block is not None:
            entry = self._blocks.get(parent_block)
            if entry is None:
                return None
            parent = entry[0]
        digests = chain(tokens, self.block_size, self.identity, parent)
        prev = parent
        for b, d in zip(blocks, digests):
            self._blocks[b] = (d, prev)
            prev = d
        return parent, digests

    def removed(self, block: int) -> tuple[bytes, bytes | None] | None:
        return self._blocks.pop(block, None)

    def get(self, block: int) -> tuple[bytes, bytes | None] | None:
        return self._blocks.get(block)
