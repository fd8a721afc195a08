"""The handover of a live rollback: a data-parallel job goes on from the step it was in.

The plan (:func:`recovery.generation.live_plan.upgrade`) chose this when every survivor's large
entries (the data-parallel model and its optimizers) are still as they were at the end
of step L, and the lost ranks' marks of L (:mod:`replication.replica_protocol.marks`) are held by
survivors. Nothing is replayed:

1. each survivor loads its own mark of L, which puts back what step L+1 had moved (the
   RNG, the data position, ...), and captures its snapshot of L; a survivor whose
   marks hold checkpoint parts (:meth:`MarkBook.declare_parts`, the Lightning
   strategy's) restores its snapshot of L instead, which it took at L
   (:func:`recovery.runtime.live_rollback.transfer` does either, before calling this);
2. each provider sends every newcomer it serves its own mark of L, and offers it that
   snapshot's slot in shared memory (:mod:`replication.side_channel.peer_memory`, ADR 0040); a
   newcomer on the same host maps it and answers yes, and then gets only its metadata;
   any other gets the large entries sent straight from the slot (copied and
   checksummed once, by the capture);
3. a newcomer that mapped the slot checks every segment's checksum there and loads
   them, while a thread allocates and touches a free slot of its own; one that did not
   receives them into a free slot of its own, every segment checked as it lands, and
   loads them. Either way it then loads its mark (checked before it is loaded), and its
   own capture of L finds that slot first: with the same layout it copies into memory
   already touched, instead of faulting in a second buffer of the state's size;
4. the committed step's snapshots and replicas stay where they are, and are not
   reseeded: the runtime commits L right after this, inside the recovery
   (:func:`recovery.runtime.live_rollback.transfer`), and that round gives every holder its
   replicas of L. A reseed of the committed step would send a newcomer every
   source's whole snapshot (it has no snapshot of its own to share segments with): on
   200 MB it cost more than the rest of the handover. A second failure before L
   commits, inside this recovery, finds the committed step's copies as the first
   failure left them;
5. a barrier on the side channel.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from replication.replica_protocol.handover import (
    HandoverResult,
    SegmentSource,
    _Laps,
    post_state,
    receive_state,
)
from replication.replica_protocol.marks import Mark, MarkBook
from replication.replica_protocol.replicas import ReplicaStore
from replication.side_channel import peer_memory, tags
from replication.side_channel.transport import SideChannel
from replication.snapshots.slots import SnapshotSlot
from replication.snapshots.snapshot import SnapshotEngine, restore_from_buffer
from replication.training_state.layout import SnapshotLayout
from replication.training_state.snapshot_meta import SnapshotMeta


def hand_over_live(
    *, channel: SideChannel, engine: SnapshotEngine, replicas: ReplicaStore, book: MarkBook,
    rank: int, live_step: int, base_step: int, providers: Mapping[int, int],
    chunk_bytes: int, captured: SnapshotSlot | None, same_host: bool = True,
) -> HandoverResult:
    """Run steps 2-5 of the module docstring on this rank; returns what moved.
    ``captured``: a survivor's sealed slot of ``live_step`` (None on a newcomer).
    ``same_host``: offer that slot's shared memory to a newcomer on this host, and read
    a provider's so (:mod:`replication.side_channel.peer_memory`); ``False`` sends every byte."""
    out = HandoverResult()
    laps = _Laps()
    sends: list = []
    served = sorted(dst for dst, p in providers.items() if p == rank)
    if served:
        assert captured is not None and captured.step == live_step
        meta = captured.meta()
        large = frozenset(book.large or ())
        skips = {}
        for dst in served:
            mark = book.peer(dst, live_step)
            skips[dst] = _not_sent(meta, mark)
            if {seg.name for seg in meta.layout.segments} - skips[dst] != large:
                raise ValueError(f"rank {dst}'s mark of step {live_step} does not hold every "
                                 "entry but the data-parallel ones")
            data = mark.to_tensor()
            header = torch.tensor([live_step, data.numel()], dtype=torch.int64)
            sends += channel.post_send(header, dst, tags.LIVE_MARK_HEADER, 1 << 30)
            sends += channel.post_send(data, dst, tags.LIVE_MARK_DATA, 1 << 30)
            out.moved += data.numel()
        in_place = _offer(channel, served, captured, same_host, sends)
        laps.lap("offer_s")
        everything = frozenset(seg.name for seg in meta.layout.segments)
        for dst in served:
            # read in place: only the metadata travels (the reader checks the bytes
            # against it); else every segment its mark does not hold
            skip = everything if dst in in_place else skips[dst]
            sends += post_state(channel, dst, meta, _bytes_of(captured), chunk_bytes,
                                skip=skip)
            out.moved += sum(s.nbytes for s in meta.layout.segments if s.name not in skip)
    if rank in providers:
        mark, buffer, meta, preparing = _receive(channel, engine, providers[rank], live_step,
                                                 chunk_bytes, same_host)
        mapped = preparing is not None
        laps.lap("map_s" if mapped else "receive_s")
        restore_from_buffer(book.subset(seg.name for seg in meta.layout.segments),
                            buffer, meta, verify=mapped)  # else verified as it landed
        del buffer  # a mapping of the provider's memory: unmapped once unreferenced
        book.restore_small(mark)
        if preparing is not None:
            preparing.join()
        else:
            out.moved += sum(s.nbytes for s in meta.layout.segments)
        out.moved += mark.buffer.numel()
        laps.lap("restore_s")
    if sends:
        channel.wait(sends, "live state transfer")
        laps.lap("send_s")
    engine.protect(base_step)
    replicas.protect(base_step)
    channel.barrier()
    laps.lap("barrier_s")
    out.parts = {k: round(v, 4) for k, v in laps.parts.items()}
    return out


def _bytes_of(slot: SnapshotSlot) -> SegmentSource:
    buf = slot.buffer
    assert buf is not None
    return lambda seg: buf[seg.offset : seg.offset + seg.nbytes]


def _not_sent(meta: SnapshotMeta, mark: Mark) -> frozenset[str]:
    """The segments of a provider's snapshot of L that a newcomer does not get: its own
    mark holds them (its small entries). Both sides apply this rule to the same mark."""
    own = {seg.name for seg in mark.meta.layout.segments}
    return frozenset(seg.name for seg in meta.layout.segments if seg.name in own)


def _offer(channel: SideChannel, served: list[int], captured: SnapshotSlot,
           same_host: bool, sends: list) -> frozenset[int]:
    """Offer the served newcomers ``captured``'s shared memory, and return those that
    will read it there (each answers at once: whether it could map it)."""
    offer = peer_memory.offer(captured.buffer) if same_host and captured.buffer is not None \
        else None
    message = offer.to_tensor() if offer is not None else peer_memory.SharedOffer.empty()
    replies = {}
    for dst in served:
        sends += channel.post_send(message, dst, tags.LIVE_OFFER, 1 << 30)
        replies[dst] = torch.zeros(1, dtype=torch.int64)
    if offer is None:
        return frozenset()
    for dst, reply in replies.items():
        channel.wait(channel.post_recv(reply, dst, tags.LIVE_REPLY, 1 << 30), "offer reply")
    return frozenset(dst for dst, reply in replies.items() if int(reply.item()) == 1)


class _SlotPreparer:
    """A newcomer reading its state in place receives into no slot of its own, so its
    capture of the live step (the commit, right after the restore) would fault in a
    fresh buffer of the state's size: on the 2-core test host that took the commit from
    0.05 s to 0.2 s. Its free slot is allocated and its pages touched on a thread
    instead, while the caller verifies and restores (the provider only waits then); the
    capture then writes into pages already touched, as after a received handover."""

    def __init__(self, engine: SnapshotEngine, layout: SnapshotLayout) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(engine, layout),
                                        name="checkpointless-slot-prepare", daemon=True)
        self._thread.start()

    def _run(self, engine: SnapshotEngine, layout: SnapshotLayout) -> None:
        try:
            slot = engine.incoming_slot(layout)
            assert slot.buffer is not None
            slot.buffer.zero_()
        except BaseException as exc:  # raised again by join()
            self._error = exc

    def join(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def _receive(channel: SideChannel, engine: SnapshotEngine, src: int, step: int,
             chunk_bytes: int, same_host: bool,
             ) -> tuple[Mark, torch.Tensor, SnapshotMeta, _SlotPreparer | None]:
    """A newcomer's mark, and the provider's large entries: read where they lie in the
    provider's shared memory when this host can map it (unchecked: the caller verifies
    them as it restores), else received into a free slot of this rank's engine, each
    verified as it lands (that slot is not a snapshot: it is invalid until a capture
    writes all of it). Returns the mark, the buffer, the metadata of the large segments
    (at their offsets in that buffer), and, when it is mapped, what prepares this rank's
    own slot meanwhile (``None`` when received)."""
    header = torch.empty(2, dtype=torch.int64)
    channel.wait(channel.post_recv(header, src, tags.LIVE_MARK_HEADER, 1 << 30), "mark header")
    got, nbytes = (int(x) for x in header.tolist())
    data = torch.empty(nbytes, dtype=torch.uint8)
    channel.wait(channel.post_recv(data, src, tags.LIVE_MARK_DATA, 1 << 30), "mark")
    mark = Mark.from_tensor(data)
    if got != step or mark.step != step:
        raise ValueError(f"rank {src} sent a mark of step {mark.step}, expected {step}")
    message = peer_memory.SharedOffer.empty()
    channel.wait(channel.post_recv(message, src, tags.LIVE_OFFER, 1 << 30), "offer")
    offer = peer_memory.SharedOffer.from_tensor(message)
    mapped = peer_memory.map_offer(offer) if offer is not None and same_host else None
    if offer is not None:
        answer = torch.tensor([int(mapped is not None)], dtype=torch.int64)
        channel.wait(channel.post_send(answer, src, tags.LIVE_REPLY, 1 << 30), "offer reply")
    buffers: list[torch.Tensor] = []
    preparing: list[_SlotPreparer] = []

    def into(meta: SnapshotMeta) -> torch.Tensor:
        if mapped is not None:
            if mapped.numel() < meta.layout.nbytes:
                raise ValueError(f"rank {src} offered {mapped.numel()} bytes of shared "
                                 f"memory for a {meta.layout.nbytes}-byte snapshot")
            buffers.append(mapped)
            preparing.append(_SlotPreparer(engine, meta.layout))
        else:
            slot = engine.incoming_slot(meta.layout)
            assert slot.buffer is not None
            buffers.append(slot.buffer)
        return buffers[0]

    def skip(meta: SnapshotMeta) -> frozenset[str]:
        if mapped is not None:  # read in place: only the metadata travels
            return frozenset(seg.name for seg in meta.layout.segments)
        return _not_sent(meta, mark)

    meta, _ = receive_state(channel, src, chunk_bytes, into=into, skip=skip)
    if meta.step != step:
        raise ValueError(f"rank {src} sent its live state as step {meta.step}, expected {step}")
    own = _not_sent(meta, mark)
    sent = tuple(seg for seg in meta.layout.segments if seg.name not in own)
    large = SnapshotMeta(step, SnapshotLayout(sent, meta.layout.nbytes),
                         {seg.name: meta.skeletons[seg.name] for seg in sent},
                         {seg.name: meta.digests[seg.name] for seg in sent})
    return mark, buffers[0], large, preparing[0] if preparing else None
