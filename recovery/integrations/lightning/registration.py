"""Entries of the checkpointless strategies in Lightning's strategy registry."""

from __future__ import annotations

NAMES = {
    "checkpointless": "DDP that survives rank and node failures in-process "
                      "(in-memory snapshots, peer replicas, durable checkpoints)",
}

_done = False


def register() -> None:
    """Add ``strategy="checkpointless"`` to Lightning's registry (idempotent)."""
    global _done
    if _done:
        return
    from lightning.pytorch.strategies import StrategyRegistry

    from recovery.integrations.lightning.strategy import CheckpointlessStrategy

    for name, description in NAMES.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, CheckpointlessStrategy, description=description)
    _done = True
