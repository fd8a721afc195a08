"""Handing a lost rank's state to its replacement, from a surviving replica holder.

The provider sends a fixed-size header (metadata length, buffer length), the snapshot
metadata, then the buffer in chunks that are all posted at once, so the transfer
streams instead of blocking per tensor. The receiver checks every segment's checksum
before a byte of it reaches the model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from replication.digest_copy import verify_segments
from replication.replicas import ReplicaStore
from replication.snapshot_meta import SnapshotMeta
from replication.transport import SideChannel

_HEADER_TAG = 1 << 29
_META_TAG = _HEADER_TAG + 1
_DATA_TAG = 1 << 24


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
