"""The handover of a recovery: a lost rank's state to its replacement, replicas reseeded.

This is the second half of the replica protocol (the first is the per-step round in
:mod:`replication.replicator`); :meth:`replication.replicator.Replicator.recover` is
its entry point, so the worker runtime only says *which* step and *who provides*, and
never touches the side channel, the snapshot engine or the replica store itself.

Call sequence of one recovery, on every rank of the new generation (all of them, in
this order, with nothing else in flight on the side channel):

1. providers post the replica they hold of each newcomer (:func:`post_state`);
2. each newcomer receives its state straight into a snapshot slot and verifies it;
3. every rank restores its own snapshot of the target step (a survivor's stays in its
   slots; a newcomer's was just adopted) and protects it and its replicas;
4. with ``replication.factor > 1``, replicas a holder lacks are reseeded
   (:func:`reseed_replicas`);
5. a barrier on the side channel: the generation starts together.

A provider sends a fixed-size header (metadata length, buffer length), the snapshot
metadata, then the buffer in chunks that are all posted at once, so the transfer
streams instead of blocking per tensor. The receiver checks every segment's checksum
before a byte of it reaches the model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from replication import tags
from replication.digest_copy import verify_segments
from replication.replicas import ReplicaStore
from replication.snapshot import SnapshotEngine
from replication.snapshot_meta import SnapshotMeta
from replication.transport import SideChannel

_HEADER_TAG = tags.HANDOVER_HEADER
_META_TAG = tags.HANDOVER_META
_DATA_TAG = tags.HANDOVER_DATA


@dataclass
class HandoverResult:
    """What one recovery's handover moved and where its time went (the recovery
    event's ``bytes_transferred`` and ``transfer_parts``)."""

    moved: int = 0
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
    serve: Callable[[int, int], tuple[SnapshotMeta, torch.Tensor]],
    rank: int, target_step: int, providers: Mapping[int, int],
    holders: Sequence[Sequence[int]], sources: Sequence[int], factor: int, chunk_bytes: int,
) -> HandoverResult:
    """Run steps 1-5 of the module docstring on this rank; returns what moved.

    ``providers`` maps each newcomer rank to the rank that sends it its state;
    ``serve(src, step)`` returns the verified replica of ``src`` held here.
    """
    out = HandoverResult()
    laps = _Laps()
    for dst, provider in sorted(providers.items()):
        if provider == rank:
            meta, buf = serve(dst, target_step)
            out.moved += send_state(channel, dst, meta, buf, chunk_bytes)
            laps.lap("send_s")
    if rank in providers:
        # Received straight into a snapshot slot: from now on this rank holds its own
        # snapshot of the target step, without capturing its state again.
        slot: Any = None

        def into_slot(meta: SnapshotMeta) -> torch.Tensor:
            nonlocal slot
            slot = engine.incoming_slot(meta.layout)
            return slot.buffer

        meta, buf = receive_state(channel, providers[rank], chunk_bytes, into=into_slot)
        laps.lap("receive_s")
        engine.adopt(slot, meta)  # checks every segment's checksum
        out.moved += buf.numel()
        laps.lap("verify_s")
    engine.restore(target_step, verify=rank not in providers)
    laps.lap("restore_s")
    engine.protect(target_step)
    replicas.protect(target_step)
    if factor > 1:
        own = engine.slot_for(target_step)
        own_meta = own.meta()
        out.moved += reseed_replicas(
            channel, rank, holders, sources, target_step,
            (own_meta, own.buffer[: own_meta.layout.nbytes]), replicas, chunk_bytes)
        laps.lap("reseed_s")
    channel.barrier()
    laps.lap("barrier_s")
    out.parts = {k: round(v, 4) for k, v in laps.parts.items()}
    return out


def send_state(
    channel: SideChannel, dst: int, meta: SnapshotMeta, buffer: torch.Tensor, chunk_bytes: int
) -> int:
    """Send a verified snapshot to ``dst``; returns the bytes sent."""
    channel.wait(post_state(channel, dst, meta, buffer, chunk_bytes),
                 f"state transfer to rank {dst}")
    return buffer.numel()


def post_state(
    channel: SideChannel, dst: int, meta: SnapshotMeta, buffer: torch.Tensor, chunk_bytes: int
) -> list:
    """Post the sends of a snapshot to ``dst`` without waiting; returns the works."""
    raw = meta.to_bytes()
    header = torch.tensor([len(raw), buffer.numel()], dtype=torch.int64)
    meta_t = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    works = channel.post_send(header, dst, _HEADER_TAG, 1 << 30)
    works += channel.post_send(meta_t, dst, _META_TAG, len(raw))
    works += channel.post_send(buffer, dst, _DATA_TAG, chunk_bytes)
    return works


def receive_state(
    channel: SideChannel, src: int, chunk_bytes: int,
    into: Callable[[SnapshotMeta], torch.Tensor] | None = None,
) -> tuple[SnapshotMeta, torch.Tensor]:
    """Receive a snapshot from ``src``. ``into(meta)``, if given, returns the buffer to
    receive into (a snapshot slot) and the caller verifies it; otherwise a new buffer
    is allocated and every segment's checksum is verified here."""
    header = torch.empty(2, dtype=torch.int64)
    channel.wait(channel.post_recv(header, src, _HEADER_TAG, 1 << 30), "state header")
    meta_len, nbytes = (int(x) for x in header.tolist())
    meta_buf = torch.empty(meta_len, dtype=torch.uint8)
    channel.wait(channel.post_recv(meta_buf, src, _META_TAG, meta_len), "state metadata")
    meta = SnapshotMeta.from_bytes(meta_buf.numpy().tobytes())
    if meta.layout.nbytes != nbytes:
        raise ValueError(f"state from rank {src}: layout says {meta.layout.nbytes} bytes, "
                         f"header says {nbytes}")
    buffer = torch.empty(nbytes, dtype=torch.uint8) if into is None else into(meta)[:nbytes]
    channel.wait(channel.post_recv(buffer, src, _DATA_TAG, chunk_bytes), "state data")
    if into is None:
        verify_segments(buffer, meta)
    return meta, buffer


def reseed_replicas(
    channel: SideChannel, rank: int, holders: Sequence[Sequence[int]],
    sources: Sequence[int], step: int, own: tuple[SnapshotMeta, torch.Tensor],
    replicas: ReplicaStore, chunk_bytes: int,
) -> int:
    """Give every holder that lacks it a full replica of ``step``; returns bytes moved.

    A newcomer starts with no replicas, and a takeover can move the placement. Without
    this, the states such a holder should keep a copy of exist once (in their own rank)
    until the next round commits, and a second failure in that window is unrecoverable:
    a rank killed in the first step after a recovery whose replica holder was the first
    victim stopped the job. Every rank learns who holds what from one allgather, so all
    of them agree on the sends; each source posts its own snapshot of ``step`` to each
    holder missing it, then receives what it lacks itself (sends first: no deadlock).
    Runs inside a recovery, before the generation's barrier, with nothing else in flight
    on ``channel``, so the tags of :func:`send_state` are free.
    """
    world = len(holders)
    mine = torch.tensor([int(replicas.holds(src, step)) for src in range(world)],
                        dtype=torch.int64)
    held = [t.tolist() for t in channel.allgather(mine)]
    meta, buffer = own
    works: list = []
    moved = 0
    for h in holders[rank]:
        if h != rank and not held[h][rank]:
            works += post_state(channel, h, meta, buffer, chunk_bytes)
            moved += buffer.numel()
    for src in sources:
        if src == rank or held[rank][src]:
            continue
        slot = None

        def into(m: SnapshotMeta, src: int = src) -> torch.Tensor:
            nonlocal slot
            slot = replicas.writable(src, m.layout.nbytes)
            assert slot.buffer is not None
            return slot.buffer

        got, buf = receive_state(channel, src, chunk_bytes, into=into)
        if got.step != step:
            raise ValueError(f"rank {src} sent its state of step {got.step}, expected {step}")
        verify_segments(buf, got)
        assert slot is not None
        replicas.adopt(slot, got)
        moved += buf.numel()
    channel.wait(works, "replica reseed")
    return moved
