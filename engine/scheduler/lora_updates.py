"""The scheduler's side of loading and unloading LoRA adapters at run time
(--allow-runtime-lora-updating).

A load goes to the workers, which read, check and attach the adapter; on their answer the
adapter gets its salt in the prefix cache's ids (engine/kv_identity.py) and requests may name
it. An unload takes the name away at once (new requests naming it are refused) and reaches the
workers only once no request of the adapter is left: the plans already sent run first, since a
rank reads its plans and updates from one socket in order.
"""

from __future__ import annotations

from collections.abc import Iterable

from deepinfer.engine.protocol import LoRAUpdate, LoRAUpdated


class RuntimeAdapters:
    def __init__(self, salts: dict[str, int], names: dict[int, str] | None = None) -> None:
        self.salts = salts  # the scheduler's: adapter name -> salt of its cache ids
        self.names = names  # the KV events' salt -> name (kept after an unload: blocks stay)
        self.loading: dict[str, LoRAUpdate] = {}  # request id -> the load the workers run
        self.unloading: dict[str, LoRAUpdate] = {}  # request id -> an unload waiting for users

    def update(self, msg: LoRAUpdate) -> tuple[LoRAUpdate | None, LoRAUpdated | None]:
        """A client's load or unload: (a load to send to the workers, or an answer now)."""
        busy = {m.name for m in (*self.loading.values(), *self.unloading.values())}
        if msg.name in busy:
            return None, LoRAUpdated(msg.request_id, f"the LoRA adapter {msg.name!r} is being "
                                                     "loaded or unloaded")
        if msg.unload:
            if msg.name not in self.salts:
                return None, LoRAUpdated(msg.request_id,
                                         f"no LoRA adapter {msg.name!r} is loaded")
            del self.salts[msg.name]
            self.unloading[msg.request_id] = msg
            return None, None
        if msg.name in self.salts:
            return None, LoRAUpdated(msg.request_id,
                                     f"a LoRA adapter named {msg.name!r} is already loaded")
        self.loading[msg.request_id] = msg
        return msg, None

    def loaded(self, answer: LoRAUpdated) -> LoRAUpdated | None:
        """The workers' answer to a load; None for a load this scheduler does not know."""
        msg = self.loading.pop(answer.request_id, None)
        if msg is None:
            return None
        if answer.error is None:
            self.salts[msg.name] = answer.salt
            if self.names is not None:
                self.names[answer.salt] = msg.name
        return answer

    def unloads_due(self, in_use: Iterable[str | None]) -> list[LoRAUpdate]:
        """Unloads whose adapter no request uses any more (each leaves the waiting list)."""
        used = set(in_use)
        due = [m for m in self.unloading.values() if m.name not in used]
        for m in due:
            del self.unloading[m.request_id]
        return due
