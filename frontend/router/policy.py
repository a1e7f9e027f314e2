"""Where the router sends a request: round robin, the least-loaded replica, or cache-aware.

Cache-aware placement (SGLang's router does the same with a radix tree) keeps, per replica, an
approximate index of the prompts it was sent: chained hashes of each prompt's prefixes at every
`chunk` characters, least recently used first out past `capacity`. A new prompt's match on a
replica is its longest indexed prefix there. The request goes to the replica with the longest
match when that covers at least `cache_threshold` of the prompt, else to the least-loaded one;
and whenever the load is out of balance (the busiest replica has more than
`balance_abs_threshold` requests in flight beyond the idlest and more than
`balance_rel_threshold` times as many), to the least-loaded one regardless.

With KV events (`block_index`, frontend/router/block_index.py) a replica that publishes them is
judged exactly instead: the share of the request's prompt tokens its cache holds, block by
block, evictions and restarts included; replicas that publish nothing keep the guess.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from deepinfer.frontend.router.block_index import BlockIndex

POLICIES = ("cache_aware", "round_robin", "least_load")


class PrefixIndex:
    def __init__(self, chunk: int = 64, capacity: int = 200_000) -> None:
        self.chunk, self.capacity = chunk, capacity
        self._keys: OrderedDict[int, None] = OrderedDict()

    def _prefix_keys(self, text: str) -> list[int]:
        keys, h = [], 0
        for i in range(0, len(text) - self.chunk + 1, self.chunk):
            h = hash((h, text[i: i + self.chunk]))
            keys.append(h)
        return keys

    def match(self, text: str) -> int:
        """Characters of `text`'s longest prefix indexed here (a multiple of `chunk`)."""
        n = 0
        for key in self._prefix_keys(text):
            if key not in self._keys:
                break
            self._keys.move_to_end(key)
            n += self.chunk
        return n

    def insert(self, text: str) -> None:
        for key in self._prefix_keys(text):
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)


@dataclass
class Replica:
    url: str
    healthy: bool = True
    in_flight: int = 0
    routed: int = 0  # requests placed here
    prefix_routed: int = 0  # of which placed for a cached prefix (cache_aware)
    index: PrefixIndex = field(default_factory=PrefixIndex)


class Policy:
    def __init__(self, name: str = "cache_aware", cache_threshold: float = 0.5,
                 balance_abs_threshold: int = 8, balance_rel_threshold: float = 1.5) -> None:
        if name not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, not {name!r}")
        self.name = name
        self.cache_threshold = cache_threshold
        self.balance_abs, self.balance_rel = balance_abs_threshold, balance_rel_threshold
        self._turn = itertools.count()
        self.block_index: BlockIndex | None = None  # set when the router follows KV events

    def choose(self, text: str, replicas: list[Replica],
               tokens: Sequence[int] | None = None, model: str | None = None) -> Replica | None:
        """The replica for a request whose prompt is `text` (None: no replica to choose);
        `tokens`, its prompt tokens, when the router knows them (KV events); `model`, what the
        request names (a LoRA adapter's blocks are its own)."""
        if not replicas:
            return None
        least = min(replicas, key=lambda r: (r.in_flight, r.routed))
        if self.name == "round_robin":
            chosen = replicas[next(self._turn) % len(replicas)]
        elif self.name == "least_load" or self._imbalanced(replicas):
            chosen = least
        else:
            # Each replica's match once (a match refreshes its index's LRU order).
            exact = self._exact(tokens, replicas, model)
            hit, _, first = max((self._share(text, tokens, r, exact), -r.in_flight, -i)
                                for i, r in enumerate(replicas))
            best = replicas[-first]
            cached = hit > 0 and hit >= self.cache_threshold
            chosen = best if cached else least
            chosen.prefix_routed += cached and chosen is best
        chosen.index.insert(text)
        chosen.routed += 1
        return chosen

    def _exact(self, tokens: Sequence[int] | None, replicas: list[Replica],
               model: str | None) -> dict[str, int]:
        if self.block_index is None or not tokens:
            return {}
        return self.block_index.match(tokens, [r.url for r in replicas], model)

    @staticmethod
    def _share(text: str, tokens: Sequence[int] | None, replica: Replica,
               exact: dict[str, int]) -> float:
        """The share of the prompt cached on `replica`: known from its events, else guessed."""
        if replica.url in exact:
            return exact[replica.url] / len(tokens)
        return replica.index.match(text) / len(text) if text else 0.0

    def _imbalanced(self, replicas: list[Replica]) -> bool:
        loads = [r.in_flight for r in replicas]
        return (max(loads) - min(loads) > self.balance_abs
                and max(loads) > self.balance_rel * min(loads))
