"""The handover of a live rollback: a data-parallel job goes on from the step it was in.

The plan (:func:`recovery.live_plan.upgrade`) chose this when every survivor's large
entries (the data-parallel model and its optimizers) are still as they were at the end
of step L, and the lost ranks' marks of L (:mod:`replication.marks`) are held by
survivors. Nothing is replayed and no snapshot is restored:

1. each survivor loads its own mark of L, which puts back what step L+1 had moved (the
   RNG, the data position, ...), and captures its snapshot of L
   (:func:`recovery.live_rollback.transfer` does both, before calling this);
2. each provider sends every newcomer it serves the large entries straight from that
   snapshot's slot (copied and checksummed once, by the capture), plus the newcomer's
   own mark of L;
3. each newcomer receives them into a free snapshot slot of its own, every segment
   checked as it lands, and loads them, then its mark (checked before it is loaded).
   Its own capture of L then finds that slot first: with the same layout it copies into
   memory already touched, instead of faulting in a second buffer of the state's size;
4. the committed step's snapshots and replicas stay where they are, and are not
   reseeded: the runtime commits L right after this, inside the recovery
   (:func:`recovery.live_rollback.transfer`), and that round gives every holder its
   replicas of L. A reseed of the committed step would send a newcomer every
   source's whole snapshot (it has no snapshot of its own to share segments with): on
   200 MB it cost more than the rest of the handover. A second failure before L
   commits, inside this recovery, finds the committed step's copies as the first
   failure left them;
5. a barrier on the side channel.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from replication import tags
from replication.handover import (
    HandoverResult,
    SegmentSource,
    _Laps,
    post_state,
    receive_state,
)
from replication.layout import SnapshotLayout
from replication.marks import Mark, MarkBook
from replication.replicas import ReplicaStore
from replication.slots import SnapshotSlot
from replication.snapshot import SnapshotEngine, restore_from_buffer
from replication.snapshot_meta import SnapshotMeta
from replication.transport import SideChannel


def hand_over_live(
    *, channel: SideChannel, engine: SnapshotEngine, replicas: ReplicaStore, book: MarkBook,
    rank: int, live_step: int, base_step: int, providers: Mapping[int, int],
    chunk_bytes: int, captured: SnapshotSlot | None,
) -> HandoverResult:
    """Run steps 2-5 of the module docstring on this rank; returns what moved.
    ``captured``: a survivor's sealed slot of ``live_step`` (None on a newcomer)."""
    out = HandoverResult()
    laps = _Laps()
    sends: list = []
    served = sorted(dst for dst, p in providers.items() if p == rank)
    if served:
        assert captured is not None and captured.step == live_step
        meta = captured.meta()
        large = frozenset(book.large or ())
        for dst in served:
            mark = book.peer(dst, live_step)
            skip = _not_sent(meta, mark)
            if {seg.name for seg in meta.layout.segments} - skip != large:
                raise ValueError(f"rank {dst}'s mark of step {live_step} does not hold every "
                                 "entry but the data-parallel ones")
            data = mark.to_tensor()
            header = torch.tensor([live_step, data.numel()], dtype=torch.int64)
            sends += channel.post_send(header, dst, tags.LIVE_MARK_HEADER, 1 << 30)
            sends += channel.post_send(data, dst, tags.LIVE_MARK_DATA, 1 << 30)
            sends += post_state(channel, dst, meta, _bytes_of(captured), chunk_bytes,
                                skip=skip)
            out.moved += sum(s.nbytes for s in meta.layout.segments if s.name not in skip)
            out.moved += data.numel()
    if rank in providers:
        mark, slot, meta = _receive(channel, engine, providers[rank], live_step, chunk_bytes)
        laps.lap("receive_s")
        assert slot.buffer is not None
        restore_from_buffer(book.subset(seg.name for seg in meta.layout.segments),
                            slot.buffer, meta, verify=False)  # verified as it landed
        book.restore_small(mark)
        out.moved += sum(s.nbytes for s in meta.layout.segments) + mark.buffer.numel()
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


def _receive(channel: SideChannel, engine: SnapshotEngine, src: int, step: int,
             chunk_bytes: int) -> tuple[Mark, SnapshotSlot, SnapshotMeta]:
    """A newcomer's mark, and the provider's large entries received into a free slot of
    this rank's engine, each verified as it lands. Returns the mark, the slot (not a
    snapshot: it is invalid until a capture writes all of it) and the metadata of what
    arrived (the large segments, at their offsets in the slot)."""
    header = torch.empty(2, dtype=torch.int64)
    channel.wait(channel.post_recv(header, src, tags.LIVE_MARK_HEADER, 1 << 30), "mark header")
    got, nbytes = (int(x) for x in header.tolist())
    data = torch.empty(nbytes, dtype=torch.uint8)
    channel.wait(channel.post_recv(data, src, tags.LIVE_MARK_DATA, 1 << 30), "mark")
    mark = Mark.from_tensor(data)
    if got != step or mark.step != step:
        raise ValueError(f"rank {src} sent a mark of step {mark.step}, expected {step}")
    slots: list[SnapshotSlot] = []

    def into(meta: SnapshotMeta) -> torch.Tensor:
        slots.append(engine.incoming_slot(meta.layout))
        assert slots[0].buffer is not None
        return slots[0].buffer

    meta, skipped = receive_state(channel, src, chunk_bytes, into=into,
                                  skip=lambda meta: _not_sent(meta, mark))
    if meta.step != step:
        raise ValueError(f"rank {src} sent its live state as step {meta.step}, expected {step}")
    sent = tuple(seg for seg in meta.layout.segments if seg.name not in skipped)
    large = SnapshotMeta(step, SnapshotLayout(sent, meta.layout.nbytes),
                         {seg.name: meta.skeletons[seg.name] for seg in sent},
                         {seg.name: meta.digests[seg.name] for seg in sent})
    return mark, slots[0], large
