"""The handover of a live rollback: a data-parallel job goes on from the step it was in.

The plan (:func:`recovery.live_plan.upgrade`) chose this when every survivor's large
entries (the data-parallel model and its optimizers) are still as they were at the end
of step L, and the lost ranks' marks of L (:mod:`replication.marks`) are held by
survivors. Nothing is replayed and no snapshot is restored:

1. each provider encodes its live large entries once (a copy and a checksum pass) and
   sends every newcomer it serves that, plus the newcomer's own mark of L;
2. each newcomer loads both (every segment checked as it lands, the mark before it is
   loaded); each survivor loads its own mark of L, which puts back what step L+1 had
   moved (the RNG, the data position, ...);
3. the committed step's snapshots and replicas stay where they are, and are not
   reseeded: the runtime snapshots L and waits for its commit right after this, inside
   the recovery (:func:`recovery.live_rollback.commit_live_step`), and that round gives
   every holder its replicas of L. A reseed of the committed step would send a newcomer
   every source's whole snapshot (it has no snapshot of its own to share segments
   with): on 200 MB it cost more than the rest of the handover. A second failure before
   L commits, inside this recovery, finds the committed step's copies as the first
   failure left them;
4. a barrier on the side channel.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from replication import tags
from replication.handover import HandoverResult, _Laps, post_state, receive_state
from replication.layout import flatten
from replication.marks import Mark, MarkBook
from replication.replicas import ReplicaStore
from replication.snapshot import SnapshotEngine, encode_to_buffer, restore_from_buffer
from replication.snapshot_meta import SnapshotMeta
from replication.transport import SideChannel


def hand_over_live(
    *, channel: SideChannel, engine: SnapshotEngine, replicas: ReplicaStore, book: MarkBook,
    rank: int, live_step: int, base_step: int, providers: Mapping[int, int],
    chunk_bytes: int,
) -> HandoverResult:
    """Run steps 1-4 of the module docstring on this rank; returns what moved."""
    out = HandoverResult()
    laps = _Laps()
    sends: list = []
    served = sorted(dst for dst, p in providers.items() if p == rank)
    if served:
        meta, buf = encode_to_buffer(flatten(book.large_state().capture()), live_step)
        laps.lap("encode_s")
        for dst in served:
            data = book.peer(dst, live_step).to_tensor()
            header = torch.tensor([live_step, data.numel()], dtype=torch.int64)
            sends += channel.post_send(header, dst, tags.LIVE_MARK_HEADER, 1 << 30)
            sends += channel.post_send(data, dst, tags.LIVE_MARK_DATA, 1 << 30)
            sends += post_state(channel, dst, meta,
                                lambda seg: buf[seg.offset : seg.offset + seg.nbytes],
                                chunk_bytes)
            out.moved += meta.layout.nbytes + data.numel()
    if rank in providers:
        mark, large = _receive(channel, providers[rank], live_step, chunk_bytes)
        laps.lap("receive_s")
        restore_from_buffer(book.subset(seg.name for seg in large[0].layout.segments),
                            large[1], large[0], verify=False)  # verified as it landed
        book.restore_small(mark)
        out.moved += large[0].layout.nbytes + mark.buffer.numel()
    else:
        assert book.own is not None and book.own.step == live_step
        book.restore_small(book.own)
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


def _receive(channel: SideChannel, src: int, step: int, chunk_bytes: int
             ) -> tuple[Mark, tuple[SnapshotMeta, torch.Tensor]]:
    """A newcomer's mark and the provider's large entries, each verified as it lands."""
    header = torch.empty(2, dtype=torch.int64)
    channel.wait(channel.post_recv(header, src, tags.LIVE_MARK_HEADER, 1 << 30), "mark header")
    got, nbytes = (int(x) for x in header.tolist())
    data = torch.empty(nbytes, dtype=torch.uint8)
    channel.wait(channel.post_recv(data, src, tags.LIVE_MARK_DATA, 1 << 30), "mark")
    mark = Mark.from_tensor(data)
    if got != step or mark.step != step:
        raise ValueError(f"rank {src} sent a mark of step {mark.step}, expected {step}")
    landed: list[torch.Tensor] = []

    def into(meta: SnapshotMeta) -> torch.Tensor:
        landed.append(torch.empty(meta.layout.nbytes, dtype=torch.uint8))
        return landed[0]

    meta, _ = receive_state(channel, src, chunk_bytes, into=into)
    if meta.step != step:
        raise ValueError(f"rank {src} sent its live state as step {meta.step}, expected {step}")
    return mark, (meta, landed[0])
