"""Which LoRA adapters are attached to the model, each in its slot of the linears' stacks
(workers/lora/adapters.py): at most --max-cpu-loras, the least recently used detached first; one
asked for again is read back from its path (the scheduler's --max-loras keeps a step's adapters
within that number)."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable

from torch import nn

from deepinfer.workers.lora.adapters import LoRAError, attach, detach

log = logging.getLogger("deepinfer.lora")


class ResidentAdapters:
    def __init__(self, model: nn.Module, paths: dict[str, str], max_rank: int,
                 capacity: int | None = None) -> None:
        self.model, self.paths, self.max_rank = model, dict(paths), max_rank
        self.capacity = capacity  # None: no limit
        # Attached adapter -> its slot, least recently used first.
        self.slots: OrderedDict[str, int] = OrderedDict()
        self.load_seconds: dict[str, float] = {}  # each adapter's last load
        for name in paths:  # each read and checked now: a bad adapter stops the start
            self.use([name])

    def use(self, names: Iterable[str]) -> dict[str, int]:
        """Attach the adapters one step uses (most recently used now), detaching the least
        recently used others beyond the capacity; each attached adapter's slot."""
        wanted = list(names)
        for name in wanted:
            if name in self.slots:
                self.slots.move_to_end(name)
                continue
            slot = min(set(range(len(self.slots) + 1)) - set(self.slots.values()))
            start = time.perf_counter()
            attach(self.model, slot, self.paths[name], self.max_rank)
            self.slots[name] = slot
            self.load_seconds[name] = time.perf_counter() - start
            log.info("LoRA adapter %s loaded in %.3f s", name, self.load_seconds[name])
        for name in [n for n in self.slots if n not in wanted]:
            if self.capacity is None or len(self.slots) <= self.capacity:
                break
            detach(self.model, self.slots.pop(name))
        return self.slots

    def add(self, name: str, path: str) -> float:
        """Serve adapter `name` from now on (--allow-runtime-lora-updating): read, checked and
        attached now; raises LoRAError, and nothing changes then. Returns the seconds it took."""
        if name in self.paths:
            raise LoRAError(f"a LoRA adapter named {name!r} is already loaded")
        self.paths[name] = path
        try:
            self.use([name])
        except Exception:
            del self.paths[name]
            raise
        return self.load_seconds[name]

    def remove(self, name: str) -> None:
        """Stop serving `name` (the scheduler sends this once no request uses it)."""
        self.paths.pop(name, None)
        self.load_seconds.pop(name, None)
        if name in self.slots:
            detach(self.model, self.slots.pop(name))
