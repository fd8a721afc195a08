"""Replicas this rank holds for its peers, double-buffered like its own snapshot.

A replica is the metadata and bytes of another rank's snapshot. Segments that were
byte-identical to this rank's own snapshot of the same step (pure data parallelism)
are not transferred or stored twice: the replica records them as *shared* and serves
them from the local snapshot when the peer's state must be rebuilt.

Replicas are host memory whatever ``replication.device`` says: only a rank's own
rollback copy has a device tier (:mod:`replication.device_tier`). They arrive over the
side channel (gloo, CPU sockets) into host memory and leave it the same way, and they
are read only when a peer is lost, so holding them on a GPU would add two PCIe
crossings per round for no faster recovery of this rank.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from replication.slots import allocate_host
from replication.snapshot_meta import SnapshotMeta


@dataclass
class ReplicaSlot:
    """One buffer for one source rank, and the step it holds."""

    src: int
    buffer: torch.Tensor | None = None
    step: int = -1
    meta: SnapshotMeta | None = None
    shared: frozenset[str] = field(default_factory=frozenset)

    @property
    def complete(self) -> bool:
        return self.meta is not None and self.step >= 0


class ReplicaStore:
    """All replicas held by this rank, two slots per source rank."""

    def __init__(self, *, pin_memory: bool = False) -> None:
        self.pin_memory = pin_memory
        self._slots: dict[int, list[ReplicaSlot]] = {}
        self._protected_step = -1
        self._lock = threading.Lock()

    def writable(self, src: int, nbytes: int) -> ReplicaSlot:
        """A slot for ``src`` that does not hold the committed step, sized to ``nbytes``."""
        with self._lock:
            slots = self._slots.setdefault(src, [ReplicaSlot(src), ReplicaSlot(src)])
            # Keep ONE copy of the committed step. Both slots can hold it: a recovery
            # re-replicates the step it rolled back to, and the protected step does
            # not change in between. Protecting both would leave no slot to write.
            kept = next((s for s in slots if s.step == self._protected_step and s.complete),
                        None)
            slot = next(s for s in sorted(slots, key=lambda s: s.step) if s is not kept)
        slot.step, slot.meta, slot.shared = -1, None, frozenset()
        if slot.buffer is None or slot.buffer.numel() != nbytes:
            slot.buffer = None
            slot.buffer = allocate_host(nbytes, pin=self.pin_memory, zeroed=False)
        return slot

    def protect(self, step: int) -> None:
        with self._lock:
            self._protected_step = step

    def get(self, src: int, step: int) -> ReplicaSlot:
        for slot in self._slots.get(src, []):
            if slot.step == step and slot.complete:
                return slot
        held = sorted(s.step for s in self._slots.get(src, []) if s.complete)
        raise KeyError(f"no replica of rank {src} at step {step} (holding steps {held})")

    def holds(self, src: int, step: int) -> bool:
        """Whether a complete replica of ``src`` at ``step`` is held here."""
        return any(s.step == step and s.complete for s in self._slots.get(src, []))

    def adopt(
        self, slot: ReplicaSlot, meta: SnapshotMeta, *, shared: frozenset[str] = frozenset()
    ) -> None:
        """Mark ``slot`` (from :meth:`writable`, its bytes received and verified) as
        holding ``meta``'s step; segments named in ``shared`` were not received and are
        served from the local snapshot of the same step."""
        slot.meta, slot.shared, slot.step = meta, shared, meta.step

    def held_steps(self) -> dict[int, list[int]]:
        """Source rank -> the steps of its complete replicas held here."""
        return {
            src: sorted(s.step for s in slots if s.complete) for src, slots in self._slots.items()
        }

    def sources(self) -> list[int]:
        return sorted(self._slots)

    def nbytes(self) -> int:
        return sum(
            s.buffer.numel()
            for slots in self._slots.values()
            for s in slots
            if s.buffer is not None
        )
