"""KV cache events in vLLM's wire format, and the log the prefix cache and the host tier fill.

External routers (vLLM's router, NVIDIA Dynamo, llm-d) learn what each server caches from
these. The structs encode as vLLM's do (msgspec `array_like=True, tag=True`): an event is a
msgpack array whose first element names it, `["BlockStored", block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium]`, `["BlockRemoved", block_hashes, medium]`,
`["AllBlocksCleared"]`; a batch is `[ts, [events...], data_parallel_rank]`.

A LoRA adapter's blocks carry the token ids as sent (not the salted ids the cache files them
under, engine/kvcache/kv_manager.py cache_tokens), `lora_id` (the adapter's salt) and, as an
8th element a consumer that knows only seven ignores, `lora_name`: a router keys them by
(adapter, prefix), as the cache does.

Block hashes are the chained digests of engine/kvcache/block_hash.py in their 64-bit form.
`medium` names the tier: "GPU" for the device cache whatever the device (consumers take "GPU" for
the primary tier, even when DeepInfer computes on a CPU), "CPU" for the host tier, "DISK" for
the disk tier.
"""

from __future__ import annotations

import time

import msgspec
import numpy as np

from deepinfer.engine.kvcache.block_hash import BlockDigests, external_hash

DEVICE = "GPU"  # the primary tier, as vLLM's consumers name it (also on CPU workers)
HOST = "CPU"
DISK = "DISK"


class BlockStored(msgspec.Struct, array_like=True, tag=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, array_like=True, tag=True, gc=False):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, array_like=True, tag=True, gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class KVEventLog:
    """Events since the last `take()`, in the order they happened. Starts with AllBlocksCleared:
    a (re)started server tells its routers to forget whatever they knew of it."""

    def __init__(self, identity: bytes, block_size: int) -> None:
        self.identity = identity
        self.block_size = block_size
        self.events: list[KVEvent] = [AllBlocksCleared()]
        self._device = BlockDigests(identity, block_size)  # blocks in the prefix cache
        self.adapters: dict[int, str] = {}  # LoRA salt -> adapter name, of every one served

    def take(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def batch(self, dp_rank: int | None) -> KVEventBatch | None:
        events = self.take()
        return KVEventBatch(time.time(), events, dp_rank) if events else None

    # ------------------------------------------------------------------ device tier

    def stored(self, parent_block: int | None, tokens, blocks: list[int]) -> None:
        """`blocks` (holding `tokens`, block after block) entered the prefix cache after the
        cached block `parent_block` (None: they start the sequence)."""
        named = self._device.stored(parent_block, tokens, blocks)
        if named is None:  # the parent was not reported as cached (cannot happen)
            return
        parent, digests = named
        self.events.append(self._block_stored(
            [external_hash(d) for d in digests], parent,
            tokens[: len(digests) * self.block_size], DEVICE))

    def removed(self, block: int) -> None:
        """`block` left the prefix cache (evicted)."""
        entry = self._device.removed(block)
        if entry is not None:
            self._remove(entry[0], DEVICE)

    def digest(self, block: int) -> tuple[bytes, bytes | None] | None:
        """(digest, parent digest) of a device block in the prefix cache."""
        return self._device.get(block)

    # ------------------------------------------------------------------ other tiers

    def tier_stored(self, medium: str, digest: bytes, parent: bytes | None, tokens) -> None:
        """A tier (HOST, DISK) now holds the block `digest` of `tokens` after `parent`."""
        self.events.append(self._block_stored([external_hash(digest)], parent, tokens, medium))

    def _block_stored(self, hashes: list[int], parent: bytes | None, tokens,
                      medium: str) -> BlockStored:
        """The event of blocks holding `tokens` as the cache files them (a LoRA adapter's
        salted above 2^32: published as sent, with the adapter named)."""
        ids = np.asarray(tokens, dtype=np.int64)
        salt = int(ids[0] >> 32) if len(ids) else 0
        if salt:
            ids = ids & 0xFFFFFFFF
        return BlockStored(hashes, _external(parent), ids.tolist(), self.block_size,
                           salt or None, medium, self.adapters.get(salt))

    def tier_removed(self, medium: str, digest: bytes) -> None:
        self._remove(digest, medium)

    def _remove(self, digest: bytes, medium: str) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(external_hash(digest))  # one event per eviction run
        else:
            self.events.append(BlockRemoved([external_hash(digest)], medium))


def _external(digest: bytes | None) -> int | None:
    return None if digest is None else external_hash(digest)
