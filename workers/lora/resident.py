"""Which LoRA adapters are attached to the model, each in its slot of the linears' stacks
(workers/lora/adapters.py): at most --max-cpu-loras, the least recently used detached first; one
asked for again is read back from its path (the scheduler's --max-loras keeps a step's adapters
within that number).

A read-back happens inside a step, so its failure must not end the step: the adapter is left
out and named, and only its requests fail (model_runner reports it in the StepResult). A read-back
must find the bytes first read: the prefix cache files the adapter's KV under a salt of those
(engine/kv_identity.py adapter_salt), so other weights under the same name would reuse KV they
did not compute."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable

from torch import nn

from deepinfer.workers.lora.adapters import LoRAError, attach, detach
from deepinfer.workers.lora.peft_files import read_adapter

log = logging.getLogger("deepinfer.lora")


class ResidentAdapters:
    def __init__(self, model: nn.Module, paths: dict[str, str], max_rank: int,
                 capacity: int | None = None) -> None:
        self.model, self.paths, self.max_rank = model, dict(paths), max_rank
        self.capacity = capacity  # None: no limit
        # Attached adapter -> its slot, least recently used first.
        self.slots: OrderedDict[str, int] = OrderedDict()
        self.load_seconds: dict[str, float] = {}  # each adapter's last load
        self.digests: dict[str, str] = {}  # each adapter's files as first read
        for name in paths:  # each read and checked now: a bad adapter stops the start
            self._attach(name)

    def use(self, names: Iterable[str]) -> tuple[dict[str, int], dict[str, str]]:
        """Attach the adapters one step uses (most recently used now), detaching the least
        recently used others beyond the capacity: (each attached adapter's slot, {adapter that
        could not be read back: why}); the step's rows of a failed one must not run with it."""
        wanted, failed = list(names), {}
        for name in wanted:
            if name in self.slots:
                self.slots.move_to_end(name)
                continue
            try:
                self._attach(name)
            except Exception as exc:  # noqa: BLE001 (gone, damaged, changed: its requests fail)
                failed[name] = load_failure(self.paths[name], exc)
                log.error("LoRA adapter %s cannot be read back: %s", name, failed[name])
        for name in [n for n in self.slots if n not in wanted]:
            if self.capacity is None or len(self.slots) <= self.capacity:
                break
            detach(self.model, self.slots.pop(name))
        return self.slots, failed

    def _attach(self, name: str) -> None:
        """Read `name`'s files and attach them in a free slot; raises (nothing changes then)."""
        path = self.paths[name]
        start = time.perf_counter()
        adapter = read_adapter(path, self.max_rank)
        first = self.digests.setdefault(name, adapter.digest)
        if adapter.digest != first:
            raise LoRAError(f"{path}: the adapter's files changed since it was loaded (unload "
                            "and load it again to serve the new ones)")
        slot = min(set(range(len(self.slots) + 1)) - set(self.slots.values()))
        attach(self.model, slot, path, adapter)
        self.slots[name] = slot
        self.load_seconds[name] = time.perf_counter() - start
        log.info("LoRA adapter %s loaded in %.3f s", name, self.load_seconds[name])

    def add(self, name: str, path: str) -> float:
        """Serve adapter `name` from now on (--allow-runtime-lora-updating): read, checked and
        attached now; raises LoRAError, and nothing changes then. Returns the seconds it took."""
        if name in self.paths:
            raise LoRAError(f"a LoRA adapter named {name!r} is already loaded")
        self.paths[name] = path
        try:
            self._attach(name)
        except Exception:
            self.remove(name)
            raise
        return self.load_seconds[name]

    def remove(self, name: str) -> None:
        """Stop serving `name` (the scheduler sends this once no request uses it)."""
        self.paths.pop(name, None)
        self.load_seconds.pop(name, None)
        self.digests.pop(name, None)
        if name in self.slots:
            detach(self.model, self.slots.pop(name))


def load_failure(path: str, exc: Exception) -> str:
    """Why an adapter cannot be served, for its clients: a LoRAError names the problem;
    anything else is named by its type alone (its message may quote the files)."""
    if isinstance(exc, LoRAError):
        return str(exc)
    return f"{path}: cannot read the adapter ({type(exc).__name__})"
