"""The exact index of what each replica caches, built from its KV events (vLLM's format).

A replica's events name blocks by its own hashes; the router cannot recompute those without the
replica's identity key, so it chains its own key per block from the token ids the events carry
(BlockStored has them): key = hash(parent's key, the block's tokens). A request's prompt tokens
give the same keys, block after block, so the longest run of keys a replica holds is its cached
prefix. A block counts as held while any of the replica's tiers (media) has it; BlockRemoved
and AllBlocksCleared apply at once.

A LoRA adapter's blocks (BlockStored's 8th element, `lora_name`) chain from the adapter's own
root key, as the replica's cache keeps them apart: a request matches them only when its `model`
names that adapter. Blocks with a `lora_id` but no adapter name are a client's cache_salt's:
they chain from a root of their own that no request reaches (the router cannot compute salts).
"""

from __future__ import annotations

from collections.abc import Sequence

_ROOT = 0  # the parent key of a sequence's first block


def _key(parent: int, block: Sequence[int]) -> int:
    # Tuples of ints hash the same in every process (no hash randomization for ints).
    return hash((parent, tuple(block)))


def _root(adapter: str | tuple | None) -> int:
    """The parent key of a sequence's first block: the base model's, or an adapter's own (or
    a salted request's: ("salt", its lora_id), which the router cannot compute)."""
    if adapter is None:
        return _ROOT
    # (str hashes are randomized per process; these keys never leave this one)
    return hash(("lora", adapter))


class BlockIndex:
    def __init__(self) -> None:
        # Per replica: its block hash -> (our key, the media holding it).
        self._blocks: dict[str, dict[int, tuple[int, set[str | None]]]] = {}
        self._block_size: dict[str, int] = {}
        self._where: dict[int, set[str]] = {}  # our key -> replicas holding that block
        self._adapters: set[str] = set()  # LoRA adapters whose blocks some replica reported

    def publishes(self, replica: str) -> bool:
        """Whether `replica` has sent events (if not, the router falls back to guessing)."""
        return replica in self._blocks

    def num_blocks(self, replica: str) -> int:
        return len(self._blocks.get(replica, ()))

    # ------------------------------------------------------------------ events in

    def apply(self, replica: str, events: list) -> None:
        """A decoded batch's events (tagged msgpack arrays) from `replica`, in order."""
        held = self._blocks.setdefault(replica, {})
        for event in events:
            if not isinstance(event, list) or not event:
                continue
            tag = event[0]
            if tag == "BlockStored" and len(event) >= 5:
                adapter = event[7] if len(event) > 7 and isinstance(event[7], str) else None
                if adapter is None and len(event) > 5 and event[5] is not None:
                    adapter = ("salt", event[5])  # a client's cache_salt: no request matches
                self._stored(replica, held, event[1], event[2], event[3], event[4],
                             event[6] if len(event) > 6 else None, adapter)
            elif tag == "BlockRemoved" and len(event) >= 2:
                self._removed(replica, held, event[1], event[2] if len(event) > 2 else None)
            elif tag == "AllBlocksCleared":
                for key, _ in held.values():
                    self._forget(key, replica)
                held.clear()

    def _stored(self, replica: str, held: dict, hashes: list, parent_hash, tokens: list,
                block_size: int, medium, adapter: str | tuple | None) -> None:
        if parent_hash is None:
            parent = _root(adapter)
            if isinstance(adapter, str):
                self._adapters.add(adapter)
        elif parent_hash in held:
            parent = held[parent_hash][0]
        else:
            return  # its prefix is unknown here (evicted meanwhile): no request can reach it
        self._block_size[replica] = block_size
        for i, h in enumerate(hashes):
            block = tokens[i * block_size:(i + 1) * block_size]
            if len(block) != block_size:
                return
            entry = held.get(h)
            if entry is None:
                parent = _key(parent, block)
                held[h] = (parent, {medium})
                self._where.setdefault(parent, set()).add(replica)
            else:
                entry[1].add(medium)
                parent = entry[0]

    def _removed(self, replica: str, held: dict, hashes: list, medium) -> None:
        for h in hashes:
            entry = held.get(h)
            if entry is None:
                continue
            entry[1].discard(medium)
            if not entry[1]:
                del held[h]
                self._forget(entry[0], replica)

    def _forget(self, key: int, replica: str) -> None:
        where = self._where.get(key)
        if where is not None:
            where.discard(replica)
            if not where:
                del self._where[key]

    # ------------------------------------------------------------------ lookup

    def match(self, tokens: Sequence[int], replicas: list[str],
              model: str | None = None) -> dict[str, int]:
        """Tokens of `tokens`' longest cached prefix on each publishing replica of `replicas`,
        for a request of `model` (a LoRA adapter's name: its blocks; else the base model's)."""
        out: dict[str, int] = {}
        by_size: dict[int, list[str]] = {}
        for r in replicas:
            if self.publishes(r):
                out[r] = 0
                if r in self._block_size:
                    by_size.setdefault(self._block_size[r], []).append(r)
        for bs, group in by_size.items():
            live, key = set(group), _root(model if model in self._adapters else None)
            for i in range(len(tokens) // bs):
                key = _key(key, tokens[i * bs:(i + 1) * bs])
                live &= self._where.get(key, set())
                if not live:
                    break
                for r in live:
                    out[r] = (i + 1) * bs
        return out
