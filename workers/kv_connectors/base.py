"""The KV-connector seam, worker half: what each step's plan entry of a connector
(engine/kvcache/connectors, engine/protocol.py KVConnectorMeta) makes this rank do before the
forward (and after it). The runner holds a list and knows none by name, and runs them through
`before_forward` below."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from deepinfer.engine.protocol import KVConnectorMeta


class WorkerConnector:
    name = ""  # the scheduler half's name: its entry in StepPlan.connectors

    def save(self, entry: KVConnectorMeta) -> None:
        """Copy out the blocks this plan takes away (evicted blocks the forward or a load may
        overwrite): runs before any connector's `before_forward`."""

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


def before_forward(connectors: Sequence[WorkerConnector],
                   entries: Mapping[str, KVConnectorMeta]) -> None:
    """A plan's connector work before its forward. A device block one connector saves may be
    another's load target in the same plan (evicted, then reused), so every connector saves
    before any loads."""
    work = [(c, entry) for c in connectors if (entry := entries.get(c.name)) is not None]
    for connector, entry in work:
        connector.save(entry)
    for connector, entry in work:
        connector.before_forward(entry)
