"""The KV-connector seam, scheduler half: somewhere outside the device cache that holds KV
blocks (host memory today; another server's cache for prefill/decode disaggregation).

A connector may
- save: be offered a full-attention block the prefix cache is about to evict (`on_evict`);
- load: continue a prefix hit with consecutive blocks it holds (`match` gives their handles,
  `plan_load` pairs each with the device block allocated for it, `cancel_loads` withdraws the
  loads of a request that could not be admitted after all);
- hand the next step plan the copies its worker half runs before the forward (`take_plan`:
  (saves, loads) as (source, target) block pairs, saves first).
The worker half (workers/kv_connector.py) carries them out. No torch here.
"""

from __future__ import annotations


class KVConnector:
    def on_evict(self, tokens, device_block: int) -> None:
        """`tokens` (every token through the block) are about to lose `device_block`."""

    def match(self, tokens, start: int, end: int) -> list[int]:
        """Handles of the blocks that continue a hit at `start`, up to `end` tokens; pinned
        until the plan being built is taken."""
        return []

    def plan_load(self, handle: int, device_block: int) -> None:
        raise NotImplementedError

    def cancel_loads(self, device_blocks: list[int]) -> None:
        """Forget the planned loads into these device blocks."""

    def take_plan(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(saves, loads) the next plan carries: (device, handle) and (handle, device)."""
        return [], []
