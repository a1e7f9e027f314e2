"""The KV-connector seam, worker half: what each step's plan entry of a connector
(engine/kvcache/connectors, engine/protocol.py KVConnectorMeta) makes this rank do before the
forward (and after it). The runner holds a list and knows none by name."""

from __future__ import annotations

from deepinfer.engine.protocol import KVConnectorMeta


class WorkerConnector:
    name = ""  # the scheduler half's name: its entry in StepPlan.connectors

    def before_forward(self, entry: KVConnectorMeta) -> None:
        """Run this step's work (only called when the plan has an entry for this connector)."""
        raise NotImplementedError

    def after_forward(self, entry: KVConnectorMeta) -> None:
        """Work on what this step's forward computed (the blocks it wrote)."""

    def close(self) -> None:
        """The worker stops: finish what must not be lost (queued writes)."""

    def ready_info(self) -> dict[str, str]:
        """What this rank tells the launcher at start (e.g. where peers reach it)."""
        return {}
