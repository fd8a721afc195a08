"""Replicas this rank holds for its peers, double-buffered like its own snapshot.

A replica is the metadata and bytes of another rank's snapshot. Segments that were
byte-identical to this rank's own snapshot of the same step (pure data parallelism)
are not transferred or stored twice: the replica records them as *shared* and serves
them from the local snapshot when the peer's state must be rebuilt.

With the device tier in use (:mod:`replication.snapshots.device_tier`), a replica that is mostly
received (not shared) lives in spare device memory when the tier's budget has room for
both of its slots after this rank's own; its bytes arrive and leave through a small
ring of host chunks (:mod:`replication.replica_protocol.replica_tier`). Otherwise it is host memory.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from replication.replica_protocol.replica_tier import StagingRing, wants_device
from replication.snapshots.device_tier import DeviceTier
from replication.snapshots.slots import allocate_host, newest_copy
from replication.training_state.snapshot_meta import SnapshotMeta


@dataclass
class ReplicaSlot:
    """One buffer for one source rank, and the step it holds."""

    src: int
    buffer: torch.Tensor | None = None
    step: int = -1
    meta: SnapshotMeta | None = None
    shared: frozenset[str] = field(default_factory=frozenset)
    on_device: bool = False  # ``buffer`` is device memory of the device tier
    seq: int = 0  # which receipt filled it: lookups take a step's newest copy (newest_copy)

    @property
    def complete(self) -> bool:
        return self.meta is not None and self.step >= 0

    def host_copy(self) -> torch.Tensor:
        """A fresh host tensor with the slot's bytes, wherever the slot lives."""
        assert self.buffer is not None
        return torch.empty(self.buffer.numel(), dtype=torch.uint8).copy_(self.buffer)


class ReplicaStore:
    """All replicas held by this rank, two slots per source rank."""

    def __init__(self, *, pin_memory: bool = False, tier: DeviceTier | None = None,
                 chunk_bytes: int = 8 << 20) -> None:
        self.pin_memory = pin_memory
        self.tier = tier
        self.chunk_bytes = chunk_bytes
        self._slots: dict[int, list[ReplicaSlot]] = {}
        self._protected_step = -1
        self._receipts = 0  # replicas received so far: each slot's seq
        self._lock = threading.Lock()
        self._ring: StagingRing | None = None

    def writable(self, src: int, nbytes: int, received: int | None = None) -> ReplicaSlot:
        """A slot for ``src`` that does not hold the committed step, sized to ``nbytes``.

        ``received``: how many of those bytes will arrive (the rest are shared with this
        rank's own snapshot); with it, the slot goes to the device tier when that is
        worth it and fits (:mod:`replication.replica_protocol.replica_tier`). ``None``: host
        memory."""
        with self._lock:
            slots = self._slots.setdefault(src, [ReplicaSlot(src), ReplicaSlot(src)])
            # Keep ONE copy of the committed step. Both slots can hold it: a recovery
            # re-replicates the step it rolled back to, and the protected step does
            # not change in between. Protecting both would leave no slot to write.
            kept = newest_copy(slots, self._protected_step, lambda s: s.complete)
            slot = next(s for s in sorted(slots, key=lambda s: s.step) if s is not kept)
        slot.step, slot.meta, slot.shared = -1, None, frozenset()
        device = self._wants_device(slot, nbytes, received)
        if slot.buffer is None or slot.buffer.numel() != nbytes or slot.on_device != device:
            self._free(slot)
            if device:
                assert self.tier is not None
                slot.buffer, slot.on_device = self.tier.allocate(nbytes), True
            else:
                slot.buffer = allocate_host(nbytes, pin=self.pin_memory, zeroed=False)
        return slot

    def _wants_device(self, slot: ReplicaSlot, nbytes: int, received: int | None) -> bool:
        """Whether ``slot`` (to be sized ``nbytes``) lives on the device tier; reserves
        the bytes of a new device buffer in the tier's budget."""
        tier = self.tier
        if tier is None or not tier.active or received is None \
                or not wants_device(nbytes, received):
            return False
        if slot.on_device and slot.buffer is not None and slot.buffer.numel() == nbytes:
            return True  # already there, already counted
        held = slot.buffer.numel() if slot.on_device and slot.buffer is not None else 0
        return tier.reserve_replica(nbytes, replacing=held)  # _free then releases ``held``

    def _free(self, slot: ReplicaSlot) -> None:
        if slot.on_device and slot.buffer is not None and self.tier is not None:
            self.tier.release_replica(slot.buffer.numel())
        slot.buffer, slot.on_device = None, False

    def ring(self) -> StagingRing:
        """The host chunks and side stream that device replicas' bytes pass through."""
        if self._ring is None:
            assert self.tier is not None and self.tier.device is not None
            self._ring = StagingRing(self.tier.device, self.chunk_bytes, pin=self.pin_memory)
        return self._ring

    def protect(self, step: int) -> None:
        with self._lock:
            self._protected_step = step

    def get(self, src: int, step: int) -> ReplicaSlot:
        """The complete replica of ``src`` at ``step``: its newest copy, if it was
        received twice (a step replicated again after a rollback to an earlier one)."""
        slot = newest_copy(self._slots.get(src, []), step, lambda s: s.complete)
        if slot is not None:
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
        slot.meta, slot.shared = meta, shared
        self.filled(slot, meta.step)

    def filled(self, slot: ReplicaSlot, step: int) -> None:
        """Record that ``slot`` now holds ``step``, as the newest receipt."""
        with self._lock:
            self._receipts += 1
            slot.step, slot.seq = step, self._receipts

    def held_steps(self) -> dict[int, list[int]]:
        """Source rank -> the steps of its complete replicas held here."""
        return {
            src: sorted(s.step for s in slots if s.complete) for src, slots in self._slots.items()
        }

    def sources(self) -> list[int]:
        return sorted(self._slots)

    def nbytes(self) -> int:
        """Host bytes held (what the host memory budget counts)."""
        return sum(
            s.buffer.numel()
            for slots in self._slots.values()
            for s in slots
            if s.buffer is not None and not s.on_device
        )

    def device_nbytes(self) -> int:
        """Device bytes held by replicas on the device tier."""
        return sum(
            s.buffer.numel()
            for slots in self._slots.values()
            for s in slots
            if s.buffer is not None and s.on_device
        )
