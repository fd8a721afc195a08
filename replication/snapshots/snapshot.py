"""Local in-memory snapshots: preallocated, reused, double-buffered.

The training loop pays only for copying live tensors into a buffer that already
exists (allocation is several times slower than the copy). Two slots alternate, so the
newest committed snapshot stays intact while the next one is written. Host tensors are
copied with streaming stores (:mod:`replication.snapshots.streamcopy`) and, by default, hashed
chunk by chunk as they are copied (``checksum="inline"``); ``"background"`` hashes the
finished slot on the replication thread instead.

With ``overlap`` (the replicator's default, ``replication.overlap_copy``) the large
tensors that only ``optimizer.step()`` changes are copied on the replication thread
while the loop runs the next forward and backward pass; an optimizer step pre-hook
fences the copy before the update (:class:`~replication.snapshots.overlap.PendingCopy`, ADR 0013).
On GPU hosts the copy is issued on a side stream of each source device into pinned host
memory (:mod:`replication.snapshots.device_copy`: a copy runs on its source device's stream, so
one stream on the current device would not cover tensors on another), and the same
fence makes every device's compute stream wait for it. CPU tests drive that path with
a simulated device whose copies land only when synchronised; only a GPU run shows the
real streams.

With a device tier (``replication.device`` auto or cuda, :mod:`replication.snapshots.device_tier`)
the slots also get a buffer in spare GPU memory once it is known to fit: a capture then
copies device to device, the seal stages those bytes into the host buffer and hashes
them as they land (the digests are the host tier's), and a rollback copies device to
device, moving no state tensor over PCIe.

With ``shared_memory=True`` (the default runtime's, ``replication.same_host_handover``,
and whenever the durable tier persists) the slots live in shared memory (a memfd): the
durable writer's helper process reads a snapshot straight from its slot
(:func:`~replication.snapshots.slots.shared_location`) and the training process copies nothing;
a slot being read that way is *held* (:meth:`SnapshotEngine.hold`) and never
overwritten until its reader is done. A replacement on the same host reads a live
rollback's state from a provider's slot the same way (:mod:`replication.side_channel.peer_memory`).

This module is the engine that decides what is copied when, and the restore; the parts
it is built from live beside it: the metadata (:mod:`replication.training_state.snapshot_meta`), the
slots and their memory (:mod:`replication.snapshots.slots`), the one-pass copy and checksum
(:mod:`replication.snapshots.digest_copy`) and the overlapped-copy machinery
(:mod:`replication.snapshots.overlap`).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from replication.snapshots import device_copy, overlap, streamcopy
from replication.snapshots.device_tier import DeviceTier, host_tensors_home
from replication.snapshots.digest_copy import compute_digests, copy_and_digest, verify_segments
from replication.snapshots.overlap import (
    DEFER_MIN_BYTES,
    PendingCopy,
    SnapshotTorn,
    _fence_before_step,
    _optimizer_owned,
    _weak_fence,
)
from replication.snapshots.replay_check import ReplayCheck
from replication.snapshots.slots import (
    SnapshotSlot,
    allocate_host,
    allocate_shared,
    newest_copy,
)
from replication.training_state import codec
from replication.training_state.layout import (
    FlatState,
    SnapshotLayout,
    flatten,
    tensor_views,
    unflatten_segment,
)
from replication.training_state.snapshot_meta import SnapshotError, SnapshotMeta
from replication.training_state.state import TrainingState

log = logging.getLogger("checkpointless.replication")


def encode_to_buffer(flat: FlatState, step: int,
                     out: torch.Tensor | None = None) -> tuple[SnapshotMeta, torch.Tensor]:
    """A flattened state's tensors copied into a host buffer, with its checksummed
    metadata: a snapshot outside the slots (:func:`restore_from_buffer` reads it back).
    For the small, short-lived ones (a live rollback's marks); captures into slots are
    the engine's.

    ``out``: host memory of at least the layout's bytes to write into (a mark's message,
    reused from step to step: fresh pages cost more than the copy into them); else a
    fresh zeroed buffer. Host tensors are copied and checksummed in one pass
    (:func:`copy_and_digest`), so a mark's gradients are read once."""
    nbytes = flat.layout.nbytes
    buf = torch.zeros(nbytes, dtype=torch.uint8) if out is None else out[:nbytes]
    if all(t.device.type == "cpu" for t in flat.tensors):
        slot = SnapshotSlot(-1, buffer=buf, layout=flat.layout,
                            views=tensor_views(buf, flat.layout))
        digests = copy_and_digest(slot, flat)
    else:  # a device's tensors: copied to the host first, then hashed there
        for dst, src in zip(tensor_views(buf, flat.layout), flat.tensors):
            dst.copy_(src)
        digests = compute_digests(buf, flat.layout, flat.skeletons)
    return SnapshotMeta(step, flat.layout, dict(flat.skeletons), digests), buf


def restore_from_buffer(state: TrainingState, buffer: torch.Tensor, meta: SnapshotMeta,
                        *, verify: bool = True) -> None:
    """Verify ``buffer`` against ``meta`` (unless the caller just did) and load it into
    the live objects.

    ``buffer`` may be a device tier's device buffer (``verify=False``: its bytes are
    hashed as they are staged to the host, see :mod:`replication.snapshots.device_tier`): the
    tensors captured from the host go back there, the others are copied on the device.

    Everything is decoded before anything is loaded, so a malformed snapshot raises
    :class:`SnapshotError` (or ``ChecksumMismatch``) and leaves the live state untouched.
    """
    if buffer.numel() < meta.layout.nbytes:
        raise SnapshotError(f"snapshot of step {meta.step} needs {meta.layout.nbytes} "
                            f"bytes, buffer holds {buffer.numel()}")
    if verify:
        verify_segments(buffer, meta)
    states = {}
    for seg in meta.layout.segments:
        seg_bytes = buffer[seg.offset : seg.offset + seg.nbytes]
        try:
            states[seg.name] = unflatten_segment(seg_bytes, seg, meta.skeletons[seg.name])
        except codec.CodecError as exc:
            raise SnapshotError(
                f"snapshot of step {meta.step}: segment {seg.name!r} cannot be decoded: {exc}"
            ) from None
    if buffer.device.type != "cpu":
        states = host_tensors_home(states)
    state.restore(states)


class SnapshotEngine:
    """Captures a :class:`TrainingState` into two reusable host buffers."""

    def __init__(
        self,
        state: TrainingState,
        *,
        pin_memory: bool | None = None,
        on_allocate: Any = None,
        checksum: str = "inline",
        shared_memory: bool = False,
        num_slots: int = 2,
        streaming: bool = True,
        overlap: bool = False,
        overlap_min_bytes: int = DEFER_MIN_BYTES,
        device_tier: DeviceTier | None = None,
    ) -> None:
        """``on_allocate(layout)`` is called before buffers are (re)allocated, so the
        caller can check the memory budget with the real snapshot size.

        ``shared_memory=True`` allocates the slots in shared memory (falling back to
        ordinary memory, with a warning, where that is impossible), for a durable
        writer that persists straight from them and for a replacement on this host
        that reads its state from them; ``num_slots=3`` keeps double buffering going
        while one slot is held by such a writer.

        ``checksum="inline"`` hashes host state during the copy (:func:`copy_and_digest`:
        the least total work, since the source is read from DRAM once); ``"background"``
        leaves hashing to :meth:`seal` on the replication thread (the shortest stall,
        but one more pass over the buffer, which competes with training when every core
        is busy). ADR 0001 has the measurements behind the default.

        ``streaming=True`` copies large host tensors with streaming stores where the C
        kernel is built (:mod:`replication.snapshots.streamcopy`); ``False`` copies with torch.

        ``overlap=True`` makes :meth:`capture` leave the large optimizer-owned host
        tensors to :meth:`seal` (:class:`PendingCopy`), which the replicator runs on
        its round thread while the loop goes on. Optimizer step pre-hooks and a restore
        guard on ``state`` fence the copy (:meth:`fence`) before anything changes those
        tensors. A seal on the capturing thread is always safe, just not overlapped.
        Optimizer-owned tensors under ``overlap_min_bytes`` are copied at capture.

        ``device_tier``: keep the slots on a device as well when it decides so
        (:mod:`replication.snapshots.device_tier`); a capture into the device tier copies device
        to device and overlaps nothing (it is already the cheap copy), the seal stages
        the bytes into the host buffer and hashes them, a restore copies on the device.
        """
        if checksum not in ("inline", "background"):
            raise ValueError(f"replication.checksum must be inline or background, got {checksum!r}")
        self.checksum = checksum
        self.streaming = streaming
        if num_slots < 2:
            raise ValueError(f"a snapshot engine needs at least 2 slots, got num_slots={num_slots}")
        self.state = state
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.shared_memory = shared_memory
        self._on_allocate = on_allocate
        self.slots = [SnapshotSlot(i) for i in range(num_slots)]
        self._lock = threading.Lock()
        self._protected_step = -1  # the committed step; its slot is never overwritten
        self._captures = 0  # captures so far: each slot's seq (see newest_copy)
        self._device_copier = device_copy.DeviceCopier()  # side streams, one per device
        self.overlap = overlap
        self.overlap_min_bytes = overlap_min_bytes
        self.tier = device_tier
        self._first_step: int | None = None  # the device tier decides after it
        self.pending: PendingCopy | None = None  # at most one: every capture fences first
        self.fence_wait_s = 0.0  # seconds spent in fence() outside capture: overlap's stall
        self.replay = ReplayCheck()  # a replayed step's digests against its first run's
        self._hooked: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any] = (
            weakref.WeakKeyDictionary()
        )
        if overlap:
            state.add_restore_guard(_weak_fence(self))

    def rebind(self, state: TrainingState) -> None:
        """Serve ``state`` from now on: a process that runs its script again in a new
        world registers new objects of the same layout, and restores its held snapshot
        into them. Any copy still reading the old objects is finished first; replay
        records are dropped (steps after the rollback run over other data now)."""
        self.fence()
        self.state = state
        self._hooked = weakref.WeakKeyDictionary()
        self.replay = ReplayCheck()
        if self.overlap:
            state.add_restore_guard(_weak_fence(self))

    def forget(self) -> None:
        """Drop every snapshot: they hold another layout (a state resharded to a new
        world size is captured again, as the same step, in the new one)."""
        self.fence()
        with self._lock:
            for slot in self.slots:
                slot.step, slot.digests, slot.on_device = -1, None, False
            self._protected_step = -1

    # -- capture ---------------------------------------------------------------------
    def capture(self, step: int) -> SnapshotSlot:
        """Copy the live state into a free slot. This is the training loop's stall.

        With :attr:`overlap`, the large optimizer-owned host tensors are left to
        :meth:`seal` (:class:`PendingCopy`) and everything else is copied now: buffers
        (a forward pass updates batch-norm statistics), RNG, small tensors, anything a
        user object owns. The skeletons (step counters, learning rates) are taken now.
        """
        self._fence()  # no earlier copy may still read the tensors (not counted as a stall)
        flat = flatten(self.state.capture())
        slot = self._free_slot()
        if slot.layout != flat.layout:
            self._allocate(slot, flat.layout)
        with self._lock:  # see seal(): a round abandoned unsealed must not finish this slot
            slot.step, slot.digests = -1, None  # invalid until fully written
            slot.pending, slot.on_device, slot.device_done = None, False, None
        on_device = self.tier is not None and self._device_ready(slot, flat, step)
        deferred = self._deferrable(flat) if self.overlap and not on_device else []
        if on_device:
            assert self.tier is not None
            # In a fresh list: the seal knows its capture by it (see seal()).
            slot.device_done = [self.tier.copy_in(slot.device_views, flat.tensors)]
            slot.on_device, slot.copy_done = True, None
        elif deferred:
            now = sorted(frozenset(range(len(flat.tensors))).difference(deferred))
            streamcopy.copy_tensors([slot.views[i] for i in now], [flat.tensors[i] for i in now],
                                    enabled=self.streaming)
        else:
            self._copy(slot, flat)
        slot.skeletons = flat.skeletons
        with self._lock:
            self._captures += 1
            slot.step, slot.seq = step, self._captures
            if deferred:
                slot.pending = self.pending = PendingCopy(slot, flat, deferred,
                                                          streaming=self.streaming)
        return slot

    def _device_ready(self, slot: SnapshotSlot, flat: FlatState, step: int) -> bool:
        """Whether this capture goes to the device tier; gives ``slot`` its device
        buffer when it does. The tier decides at the first capture of a step after the
        first one captured: the allocator has seen a whole step's peak by then."""
        tier = self.tier
        assert tier is not None and slot.layout is not None
        if tier.active is None:
            if self._first_step is None or self._first_step == step:
                self._first_step = step
                return False
            need = len(self.slots) * flat.layout.nbytes
            if not tier.decide(flat.tensors, need, self.device_bytes):
                return False
        if not tier.active:
            return False
        if slot.device_buffer is None or slot.device_buffer.numel() != slot.layout.nbytes:
            slot.device_buffer, slot.device_views = None, []
            if not tier.admit(len(self.slots) * slot.layout.nbytes):
                self._drop_device_buffers()
                return False
            slot.device_buffer = tier.allocate(slot.layout.nbytes)
            slot.device_views = tensor_views(slot.device_buffer, slot.layout)
        return True

    def _drop_device_buffers(self) -> None:
        for s in self.slots:
            if not s.on_device or s.step < 0:
                s.device_buffer, s.device_views = None, []

    def _deferrable(self, flat: FlatState) -> list[int]:
        """Positions of the tensors an overlapped capture leaves to :class:`PendingCopy`;
        hooks every registered optimizer that owns one, so its step fences the copy."""
        optimizers, owned = _optimizer_owned(self.state)
        deferred = [
            i for i, t in enumerate(flat.tensors)
            if t.device.type == "cpu" and t.is_contiguous() and not t.is_inference()
            and t.numel() * t.element_size() >= self.overlap_min_bytes
            and t.data_ptr() in owned
        ]
        if deferred:
            self._hook(optimizers)
        return deferred

    def _hook(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Make each optimizer's step fence this engine's copies first (once each)."""
        for opt in optimizers:
            if opt not in self._hooked:
                self._hooked[opt] = opt.register_step_pre_hook(
                    functools.partial(_fence_before_step, weakref.ref(self))
                )

    def fence(self) -> float:
        """Return once no snapshot copy reads the live tensors; the seconds it took.

        Called before anything changes them: by optimizer step pre-hooks, before a
        restore, and by :meth:`capture`. What is left of a pending copy is done here,
        on the calling thread (:class:`PendingCopy`). On GPU hosts, makes the compute
        stream of every device that copies come from wait for them. A tensor found
        changed since the capture (outside ``optimizer.step()``, or the fence would
        have come first) turns overlapped copies off for this engine, with a warning:
        this loop cannot use them safely.
        The time is added to :attr:`fence_wait_s`.
        """
        waited = self._fence()
        self.fence_wait_s += waited
        return waited

    def _fence(self) -> float:
        pending, t0 = self.pending, time.perf_counter()
        if pending is not None:
            self.pending = None
            try:
                pending.run()
            except Exception:  # seal() raises it, in the round
                pass
            changed = pending.changed()
            if self.overlap and (changed or isinstance(pending.error, SnapshotTorn)):
                self.overlap = False
                log.warning(
                    "overlapped snapshot copies are off for the rest of this run: %s "
                    "changed in place between the capture of step %d and the next "
                    "optimizer.step() (if the change was still running when the copy "
                    "ended, that snapshot is torn); set replication.overlap_copy=false "
                    "for this loop", ", ".join(changed[:3]) or "a tensor", pending.step,
                )
        for slot in self.slots:
            events = slot.copy_done  # read once: seal() clears it on the round thread
            if events is not None:  # device copies in flight: every device's compute stream
                device_copy.wait_on_compute_streams(events)
        return time.perf_counter() - t0

    def _free_slot(self) -> SnapshotSlot:
        """The oldest slot that is neither committed nor held by a reader; if every
        uncommitted slot is held, wait for the oldest one's reader (see :meth:`hold`)."""
        while True:
            with self._lock:
                # One slot keeps the committed step; a second copy of it (the step a
                # recovery rolled back to, captured again) is as free as any other. The
                # one kept is the newest copy: an older one may be from a round that
                # never committed (see newest_copy).
                kept = newest_copy(self.slots, self._protected_step, lambda s: not s.empty)
                free = [s for s in sorted(self.slots, key=lambda s: s.step) if s is not kept]
                if not free:  # pragma: no cover - at least two slots, one kept
                    raise SnapshotError("no free snapshot slot")
                for slot in free:
                    if slot.hold is None:
                        return slot
                slot, wait = free[0], free[0].hold
            assert wait is not None
            wait()  # returns once the reader is done with the slot
            self.unhold(slot, wait)

    def hold(self, slot: SnapshotSlot, wait: Callable[[], None]) -> None:
        """Keep :meth:`capture` from overwriting ``slot`` until :meth:`unhold`.

        For a reader outside the engine that needs the slot's bytes as they are (a
        durable writer persisting straight from the slot). Captures take another free
        slot while there is one; a capture that finds only held slots calls ``wait()``,
        which must return only once the reader is done with the slot (cancelling it
        if it takes too long), and then writes into it.
        """
        with self._lock:
            slot.hold = wait

    def unhold(self, slot: SnapshotSlot, wait: Callable[[], None] | None = None) -> None:
        """End :meth:`hold` (only the hold placed with ``wait``, when given)."""
        with self._lock:
            if wait is None or slot.hold is wait:
                slot.hold = None

    def _allocate(self, slot: SnapshotSlot, layout: SnapshotLayout) -> None:
        if self._on_allocate is not None:
            self._on_allocate(layout)
        slot.buffer, slot.views = None, []  # drop the old buffer before allocating the new one
        slot.device_buffer, slot.device_views, slot.on_device = None, [], False
        buf = allocate_shared(layout.nbytes, pin=self.pin_memory) if self.shared_memory else None
        if buf is None and self.shared_memory and layout.nbytes > 0:
            log.warning("cannot allocate a %d MB snapshot buffer in shared memory: using "
                        "private memory (the durable writer copies snapshots, and a "
                        "replacement on this host receives them over the network)",
                        layout.nbytes >> 20)
        slot.buffer = buf if buf is not None else allocate_host(layout.nbytes, pin=self.pin_memory)
        slot.layout = layout
        slot.views = tensor_views(slot.buffer, layout)

    def _copy(self, slot: SnapshotSlot, flat: FlatState) -> None:
        if all(t.device.type == "cpu" for t in flat.tensors):
            if self.checksum == "inline":
                slot.digests = copy_and_digest(slot, flat, streaming=self.streaming)
            else:
                streamcopy.copy_tensors(slot.views, flat.tensors, enabled=self.streaming)
            return
        # Device path: enqueue device->pinned copies on a side stream of each source
        # device (replication.snapshots.device_copy). What the next forward pass may change
        # (buffers such as batch-norm statistics, all but the optimizers' tensors) goes
        # first, and every device's compute stream waits for that part before it runs
        # anything else; the optimizers' step pre-hooks make them wait for the rest
        # before the update (fence()).
        optimizers, owned = _optimizer_owned(self.state)
        self._hook(optimizers)
        pairs = list(zip(slot.views, flat.tensors))
        early = [p for p in pairs if p[1].data_ptr() not in owned]
        late = [p for p in pairs if p[1].data_ptr() in owned]
        early_done, slot.copy_done = self._device_copier.copy([early, late])
        device_copy.wait_on_compute_streams(early_done)

    def seal(self, slot: SnapshotSlot, *, low_priority: bool = False) -> SnapshotMeta:
        """Finish ``slot`` and checksum it (off the training thread, in the replicator).

        Does an overlapped capture's pending copy (:class:`PendingCopy`, raising
        :class:`SnapshotTorn` if it is torn), waits for an async device copy, and
        hashes what the capture did not already hash. ``low_priority`` does the pending
        copy on a thread of its own at the lowest CPU priority (:func:`run_niced`).
        """
        pending = slot.pending
        if pending is not None:
            if low_priority:
                # looked up on the module at call time, so a test can stand in for it
                overlap.run_niced(lambda: pending.run(background=True))
            digests = pending.run()  # the digests, or the copy's error
            with self._lock:
                # A round abandoned in a recovery may get here after the slot was
                # captured again: the slot is no longer its snapshot.
                if slot.pending is not pending:
                    raise SnapshotError(f"the slot of step {pending.step} was reused "
                                        "before its round sealed it")
                slot.digests, slot.pending = digests, None
        if slot.copy_done is not None:
            device_copy.synchronize(slot.copy_done)
            slot.copy_done = None
        assert slot.buffer is not None and slot.layout is not None
        if slot.on_device and slot.digests is None:
            assert self.tier is not None and slot.device_buffer is not None
            captured = slot.device_done
            assert captured is not None
            digests = self.tier.stage(slot.device_buffer, slot.buffer, slot.layout,
                                      slot.skeletons, captured[0])
            with self._lock:  # as for a pending copy: an abandoned round's late seal
                if slot.device_done is not captured:
                    raise SnapshotError(f"the slot of step {slot.step} was reused before "
                                        "its round sealed it")
                slot.digests, slot.device_done = digests, None
        if slot.digests is None:
            slot.digests = compute_digests(slot.buffer, slot.layout, slot.skeletons)
        self.replay.record(slot.step, slot.digests, self.state.replay_exempt)
        return slot.meta()

    # -- a snapshot received from elsewhere ---------------------------------------------
    def incoming_slot(self, layout: SnapshotLayout) -> SnapshotSlot:
        """A free slot, sized for ``layout`` and marked invalid, for a snapshot that
        arrives over the network (a replacement's own state, from its replica): it is
        received straight into the slot, so the replacement holds its snapshot without
        capturing its restored state again (one pass over the bytes instead of three).
        Finish with :meth:`adopt`."""
        self._fence()
        slot = self._free_slot()
        if slot.layout != layout or slot.buffer is None:
            self._allocate(slot, layout)
        with self._lock:
            slot.step, slot.digests, slot.pending, slot.skeletons = -1, None, None, {}
            slot.on_device = False  # the bytes arrive in the host buffer only
        return slot

    def adopt(self, slot: SnapshotSlot, meta: SnapshotMeta, *, verified: bool = False) -> None:
        """Seal ``slot`` (from :meth:`incoming_slot`, its bytes written) as ``meta``'s
        snapshot, after checking every segment against ``meta``'s checksums (unless the
        caller did, ``verified``, as the bytes arrived)."""
        assert slot.buffer is not None and slot.layout == meta.layout
        if not verified:
            verify_segments(slot.buffer, meta)
        with self._lock:
            slot.skeletons, slot.digests = dict(meta.skeletons), dict(meta.digests)
            self._captures += 1  # received, not captured: still the step's newest copy
            slot.step, slot.seq = meta.step, self._captures

    # -- commit bookkeeping ------------------------------------------------------------
    def discard(self, slot: SnapshotSlot) -> None:
        """Forget what ``slot`` holds (a capture nothing will use): free for the next."""
        with self._lock:
            slot.step, slot.digests, slot.pending, slot.skeletons = -1, None, None, {}

    def protect(self, step: int) -> None:
        """Record that ``step`` is committed: its slot must survive the next capture."""
        with self._lock:
            self._protected_step = step

    @property
    def protected_step(self) -> int:
        return self._protected_step

    def slot_for(self, step: int) -> SnapshotSlot:
        """The sealed slot of ``step``: its newest copy, if it was captured twice."""
        slot = newest_copy(self.slots, step, lambda s: s.digests is not None)
        if slot is not None:
            return slot
        held = sorted(s.step for s in self.slots if not s.empty)
        raise SnapshotError(f"no sealed local snapshot of step {step} (holding steps {held})")

    def held_steps(self) -> list[int]:
        return sorted(s.step for s in self.slots if not s.empty and s.digests is not None)

    # -- restore -------------------------------------------------------------------
    def restore(self, step: int, *, verify: bool = True) -> None:
        """Roll the live objects back to the local snapshot of ``step``, verified
        (``verify=False`` only right after :meth:`adopt` checked the same bytes)."""
        slot = self.slot_for(step)
        assert slot.buffer is not None
        if slot.on_device and slot.device_buffer is not None:
            # Device to device: nothing crosses PCIe. The bytes were hashed as the seal
            # staged them; their host copy is not re-read for a check.
            restore_from_buffer(self.state, slot.device_buffer, slot.meta(), verify=False)
            return
        restore_from_buffer(self.state, slot.buffer, slot.meta(), verify=verify)

    @property
    def state_bytes(self) -> int:
        return max((s.layout.nbytes for s in self.slots if s.layout is not None), default=0)

    @property
    def allocated_bytes(self) -> int:
        """Host bytes held by the slots' buffers."""
        return sum(s.buffer.numel() for s in self.slots if s.buffer is not None)

    @property
    def device_bytes(self) -> int:
        """Device bytes held by the slots' device-tier buffers."""
        return sum(s.device_buffer.numel() for s in self.slots if s.device_buffer is not None)
