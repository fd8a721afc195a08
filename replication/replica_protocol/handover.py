"""The handover of a recovery: a lost rank's state to its replacement, replicas reseeded.

This is the second half of the replica protocol (the first is the per-step round in
:mod:`replication.replica_protocol.replicator`);
:meth:`replication.replica_protocol.replicator.Replicator.recover` is
its entry point, so the worker runtime only says *which* step and *who provides*, and
never touches the side channel, the snapshot engine or the replica store itself.

Call sequence of one recovery, on every rank of the new generation (all of them, in
this order, with nothing else in flight on the side channel):

1. providers post the replica they hold of each newcomer (:func:`post_state`);
2. each newcomer receives its state straight into a snapshot slot, verifying it as it
   lands;
3. every rank restores its own snapshot of the target step (a survivor's stays in its
   slots; a newcomer's was just adopted) and protects it and its replicas;
4. with ``replication.factor > 1``, replicas a holder lacks are reseeded
   (:func:`reseed_replicas`);
5. a barrier on the side channel: the generation starts together.

A sender posts a fixed-size header (metadata length, buffer length), the snapshot
metadata, then each segment's bytes in chunks, all at once, so the transfer streams
instead of blocking per tensor. It reads them where they lie (a provider's replica
slot, and its own snapshot for the segments the replica shares with it), so serving
costs no copy. The receiver hashes each chunk as it lands and checks every segment's
checksum before a byte of it reaches the model. A reseed skips the segments the
receiver's own snapshot already holds (equal fingerprints: pure data parallelism),
which the receiver then records as shared, as a replication round does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from replication.replica_protocol.replica_tier import StagingRing, receive_staged, send_staged
from replication.replica_protocol.replicas import ReplicaSlot, ReplicaStore
from replication.side_channel import tags
from replication.side_channel.tags import MAX_SEGMENTS
from replication.side_channel.transport import SideChannel
from replication.snapshots.digest_copy import verify_as_they_land
from replication.snapshots.snapshot import SnapshotEngine
from replication.training_state.layout import SegmentLayout, SnapshotLayout
from replication.training_state.snapshot_meta import SnapshotMeta

_HEADER_TAG = tags.HANDOVER_HEADER
_META_TAG = tags.HANDOVER_META
_DATA_TAG = tags.HANDOVER_DATA


SegmentSource = Callable[[SegmentLayout], torch.Tensor]
"""A segment's bytes (a contiguous uint8 view of ``seg.nbytes``), wherever they lie."""


@dataclass(frozen=True)
class Served:
    """A replica a provider sends: its metadata, where its segments lie, and the staging
    ring when they lie in device memory (gloo sends host memory only,
    :mod:`replication.replica_protocol.replica_tier`); ``None``: host memory, sent where it lies."""

    meta: SnapshotMeta
    source: SegmentSource
    ring: StagingRing | None = None


@dataclass
class HandoverResult:
    """What one recovery's handover moved and where its time went (the recovery
    event's ``bytes_transferred`` and ``transfer_parts``)."""

    moved: int = 0
    skipped: int = 0  # bytes a reseed left out: the receiver's own snapshot has them
    parts: dict[str, float] = field(default_factory=dict)


class _Laps:
    """Seconds per named part, measured back to back."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.parts[name] = self.parts.get(name, 0.0) + now - self._t
        self._t = now


def hand_over(
    *, channel: SideChannel, engine: SnapshotEngine, replicas: ReplicaStore,
    serve: Callable[[int, int], Served],
    rank: int, target_step: int, providers: Mapping[int, int],
    holders: Sequence[Sequence[int]], sources: Sequence[int], factor: int, chunk_bytes: int,
    dedupe: bool = True,
) -> HandoverResult:
    """Run steps 1-5 of the module docstring on this rank; returns what moved.

    ``providers`` maps each newcomer rank to the rank that sends it its state;
    ``serve(src, step)`` returns the replica of ``src`` held here (:class:`Served`); one
    in device memory is sent through host chunks before this rank goes on. ``dedupe``
    lets a reseed skip what the receiver already holds (``replication.dedupe``).
    """
    out = HandoverResult()
    laps = _Laps()
    sends: list = []
    for dst, provider in sorted(providers.items()):
        if provider == rank:
            served = serve(dst, target_step)
            sends += post_state(channel, dst, served.meta, served.source, chunk_bytes,
                                ring=served.ring)
            out.moved += served.meta.layout.nbytes
    if rank in providers:
        # Received straight into a snapshot slot: from now on this rank holds its own
        # snapshot of the target step, without capturing its state again.
        slot: Any = None

        def into_slot(meta: SnapshotMeta) -> torch.Tensor:
            nonlocal slot
            slot = engine.incoming_slot(meta.layout)
            return slot.buffer

        meta, _ = receive_state(channel, providers[rank], chunk_bytes, into=into_slot)
        engine.adopt(slot, meta, verified=True)  # every segment checked as it landed
        out.moved += meta.layout.nbytes
        laps.lap("receive_s")
    engine.restore(target_step, verify=rank not in providers)  # while sends stream
    laps.lap("restore_s")
    if sends:
        channel.wait(sends, "state transfer")
        laps.lap("send_s")
    engine.protect(target_step)
    replicas.protect(target_step)
    if factor > 1:
        own = engine.slot_for(target_step)
        moved, out.skipped = reseed_replicas(
            channel, rank, holders, sources, target_step, own.meta(),
            lambda seg: own.segment_bytes(seg.name), replicas, chunk_bytes, dedupe=dedupe)
        out.moved += moved
        laps.lap("reseed_s")
    channel.barrier()
    laps.lap("barrier_s")
    out.parts = {k: round(v, 4) for k, v in laps.parts.items()}
    return out


def _pieces(
    layout: SnapshotLayout, source: SegmentSource, chunk_bytes: int, skip: frozenset[str]
) -> list[tuple[str, list[torch.Tensor]]]:
    """Per segment sent (in layout order, ``skip`` left out), its bytes cut into chunks:
    sender and receiver cut the same way, so piece ``i`` on one side is piece ``i`` on
    the other. A segment without bytes has no chunks (its skeleton travels in the
    metadata), but is listed so its checksum is still checked."""
    out = []
    for seg in layout.segments:
        if seg.name in skip:
            continue
        view = source(seg) if seg.nbytes else None
        out.append((seg.name, [] if view is None else
                    [view[i : i + chunk_bytes] for i in range(0, seg.nbytes, chunk_bytes)]))
    return out


def post_state(
    channel: SideChannel, dst: int, meta: SnapshotMeta, source: SegmentSource,
    chunk_bytes: int, skip: frozenset[str] = frozenset(), ring: StagingRing | None = None,
) -> list:
    """Post the sends of a snapshot to ``dst`` without waiting; returns the works.
    Segments named in ``skip`` are not sent (the receiver must skip the same). With
    ``ring`` (segments in device memory), the bytes are staged through it chunk by
    chunk and sent before this returns: only the header's and metadata's works are
    returned then."""
    raw = meta.to_bytes()
    header = torch.tensor([len(raw), meta.layout.nbytes], dtype=torch.int64)
    meta_t = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    works = channel.post_send(header, dst, _HEADER_TAG, 1 << 30)
    works += channel.post_send(meta_t, dst, _META_TAG, len(raw))
    chunks = [c for _, cs in _pieces(meta.layout, source, chunk_bytes, skip) for c in cs]
    if ring is not None:
        send_staged(channel, dst, [(_DATA_TAG + i, c) for i, c in enumerate(chunks)], ring,
                    f"state for rank {dst}")
    else:
        works += channel.post_send_pieces(chunks, dst, _DATA_TAG)
    return works


def receive_state(
    channel: SideChannel, src: int, chunk_bytes: int,
    into: Callable[[SnapshotMeta], torch.Tensor],
    skip: Callable[[SnapshotMeta], frozenset[str]] = lambda meta: frozenset(),
    ring: Callable[[], StagingRing | None] = lambda: None,
) -> tuple[SnapshotMeta, frozenset[str]]:
    """Receive a snapshot from ``src`` into the buffer ``into(meta)`` returns (a slot,
    laid out as ``meta.layout``), checking every received segment's checksum as its
    chunks land. ``skip(meta)`` names the segments the sender leaves out; returns the
    metadata and those names. ``ring()``, asked once ``into`` has run, is the staging
    ring when that buffer is device memory
    (:func:`replication.replica_protocol.replica_tier.receive_staged`)."""
    header = torch.empty(2, dtype=torch.int64)
    channel.wait(channel.post_recv(header, src, _HEADER_TAG, 1 << 30), "state header")
    meta_len, nbytes = (int(x) for x in header.tolist())
    meta_buf = torch.empty(meta_len, dtype=torch.uint8)
    channel.wait(channel.post_recv(meta_buf, src, _META_TAG, meta_len), "state metadata")
    meta = SnapshotMeta.from_bytes(meta_buf.numpy().tobytes())
    if meta.layout.nbytes != nbytes:
        raise ValueError(f"state from rank {src}: layout says {meta.layout.nbytes} bytes, "
                         f"header says {nbytes}")
    buffer = into(meta)[:nbytes]
    skipped = skip(meta)
    pieces = _pieces(meta.layout, lambda seg: buffer[seg.offset : seg.offset + seg.nbytes],
                     chunk_bytes, skipped)
    what = f"state from rank {src}"
    staging = ring()
    if staging is not None:
        tags = iter(range(_DATA_TAG, _DATA_TAG + sum(len(cs) for _, cs in pieces)))
        receive_staged(channel, src, [(name, [(next(tags), c) for c in cs])
                                      for name, cs in pieces], meta, staging, what)
        return meta, skipped
    works = iter(channel.post_recv_pieces([c for _, cs in pieces for c in cs], src, _DATA_TAG))
    pending = [(name, [next(works) for _ in cs]) for name, cs in pieces]
    verify_as_they_land(pending, meta, lambda w: channel.wait([w], what), what)
    return meta, skipped


def reseed_replicas(
    channel: SideChannel, rank: int, holders: Sequence[Sequence[int]],
    sources: Sequence[int], step: int, own_meta: SnapshotMeta, own_source: SegmentSource,
    replicas: ReplicaStore, chunk_bytes: int, *, dedupe: bool = True,
) -> tuple[int, int]:
    """Give every holder that lacks it a replica of ``step``; returns the bytes this
    rank moved, and those it left out (sent or received) because the receiver held them.

    A newcomer starts with no replicas, and a takeover can move the placement. Without
    this, the states such a holder should keep a copy of exist once (in their own rank)
    until the next round commits, and a second failure in that window is unrecoverable:
    a rank killed in the first step after a recovery whose replica holder was the first
    victim stopped the job. Every rank learns who holds what, and the fingerprints of
    every rank's own snapshot of ``step``, from one allgather, so all of them agree on
    the sends; each source posts its own snapshot to each holder missing it, leaving out
    the segments that holder's own snapshot already has, then receives what it lacks
    itself (sends first: no deadlock). Runs inside a recovery, before the generation's
    barrier, with nothing else in flight on ``channel``, so the handover's tags are free.
    """
    world = len(holders)
    fps = own_meta.fingerprints() if dedupe else []
    if len(fps) > MAX_SEGMENTS:
        raise ValueError(f"{len(fps)} state entries; at most {MAX_SEGMENTS} are supported")
    mine = torch.zeros(world + 1 + MAX_SEGMENTS, dtype=torch.int64)
    mine[:world] = torch.tensor([int(replicas.holds(src, step)) for src in range(world)])
    mine[world] = len(fps)
    mine[world + 1 : world + 1 + len(fps)] = torch.tensor(fps, dtype=torch.int64)
    rows = [t.tolist() for t in channel.allgather(mine)]
    held = [r[:world] for r in rows]
    has = [set(r[world + 1 : world + 1 + r[world]]) for r in rows]
    works: list = []
    moved = skipped = 0
    for h in holders[rank]:
        if h != rank and not held[h][rank]:
            skip = _shared_with(own_meta, has[h])
            works += post_state(channel, h, own_meta, own_source, chunk_bytes, skip)
            moved += own_meta.layout.nbytes - _nbytes(own_meta, skip)
            skipped += _nbytes(own_meta, skip)
    for src in sources:
        if src == rank or held[rank][src]:
            continue
        landing = _Landing(replicas, src, has[rank])
        got, shared = receive_state(channel, src, chunk_bytes, into=landing.into,
                                    skip=lambda m: _shared_with(m, has[rank]),
                                    ring=landing.ring)
        if got.step != step:
            raise ValueError(f"rank {src} sent its state of step {got.step}, expected {step}")
        slot = landing.slot
        assert slot is not None
        replicas.adopt(slot, got, shared=shared)
        moved += got.layout.nbytes - _nbytes(got, shared)
        skipped += _nbytes(got, shared)
    channel.wait(works, "replica reseed")
    return moved, skipped


class _Landing:
    """The replica slot a reseed receives ``src``'s state into, chosen once its metadata
    says how much will arrive (device memory or host: :meth:`ReplicaStore.writable`)."""

    def __init__(self, replicas: ReplicaStore, src: int, mine: set[int]) -> None:
        self.replicas, self.src, self.mine = replicas, src, mine
        self.slot: ReplicaSlot | None = None

    def into(self, meta: SnapshotMeta) -> torch.Tensor:
        received = meta.layout.nbytes - _nbytes(meta, _shared_with(meta, self.mine))
        self.slot = self.replicas.writable(self.src, meta.layout.nbytes, received)
        assert self.slot.buffer is not None
        return self.slot.buffer

    def ring(self) -> StagingRing | None:
        assert self.slot is not None
        return self.replicas.ring() if self.slot.on_device else None


def _nbytes(meta: SnapshotMeta, names: frozenset[str]) -> int:
    return sum(seg.nbytes for seg in meta.layout.segments if seg.name in names)


def _shared_with(meta: SnapshotMeta, fingerprints: set[int]) -> frozenset[str]:
    """The segments of ``meta`` whose fingerprint is among ``fingerprints``."""
    return frozenset(seg.name for i, seg in enumerate(meta.layout.segments)
                     if seg.nbytes and meta.fingerprint(i) in fingerprints)
