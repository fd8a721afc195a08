"""Replicas held for peers in spare device memory, and the staging that moves them.

With ``replication.device: auto`` (the default) or ``cuda``, once the device tier is in
use for this rank's own snapshots (:mod:`replication.snapshots.device_tier`), the replicas it
keeps of its peers' snapshots go to the same device when they fit the budget that tier
fixed (free memory after the first step's peak, less the headroom), after its own
slots: a rank's own rollback copy comes first. Otherwise they stay in host memory.

Only replicas that are mostly *received* go to the device. A pure data-parallel peer's
replica is almost all shared with this rank's own snapshot (equal segments are not sent
or stored twice, :mod:`replication.replica_protocol.replicas`): its host buffer's untouched pages
cost
nothing, while a device buffer would hold the whole layout for nothing. So a source
whose received bytes are under half its snapshot keeps a host replica.

The side channel is gloo over host sockets, which reads and writes host memory only.
Bytes bound for a device replica therefore land in a small ring of host chunks (pinned
on GPU hosts), are hashed there as they land (the same checksum as a host replica's,
:func:`replication.snapshots.digest_copy.segment_digest`), and are copied to the device on a side
stream while the next chunks arrive; a chunk is reused only once its copy has ended.
Serving a device replica to a replacement runs the other way: each chunk is staged
from the device into the ring and sent, with a bounded number in flight. Neither
direction holds a host copy of the whole replica.

Like the device tier, the code is written against torch's device API, so CPU tests run
every path with the CPU as the "device" (and the ring's copies then happen at once).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import torch

from replication.snapshots import checksum
from replication.snapshots.device_copy import device_module
from replication.snapshots.digest_copy import segment_trailer
from replication.snapshots.slots import allocate_host
from replication.training_state.snapshot_meta import SnapshotMeta

RING_CHUNKS = 4  # host chunks in flight per staged transfer
RECEIVED_SHARE = 0.5  # a replica goes to the device only if at least this share arrives

SegmentPieces = Sequence[tuple[str, Sequence[tuple[int, torch.Tensor]]]]
"""Per segment name, in order: its pieces as (gloo tag, destination view)."""


def wants_device(nbytes: int, received: int) -> bool:
    """Whether a replica of ``nbytes`` of which ``received`` arrive is worth device
    memory (see the module docstring: shared segments are never stored)."""
    return nbytes > 0 and received >= RECEIVED_SHARE * nbytes


class StagingRing:
    """A few host chunks, and a side stream of the device, for staged transfers.

    One ring per replica store: transfers using it run one at a time (a round's
    receives run on the round thread, a recovery's on the training thread while no
    round runs), so the chunks are never shared by two transfers at once.
    """

    def __init__(self, device: torch.device, chunk_bytes: int, *, pin: bool) -> None:
        self.device = device
        self.chunk_bytes = chunk_bytes
        self._chunks = [allocate_host(chunk_bytes, pin=pin, zeroed=False)
                        for _ in range(RING_CHUNKS)]
        mod = device_module(device)
        self._mod = mod
        self._side = mod.Stream(device=device) if device.type != "cpu" else mod.Stream()

    def chunk(self, i: int, nbytes: int) -> torch.Tensor:
        return self._chunks[i % RING_CHUNKS][:nbytes]

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """``dst.copy_(src)`` on the side stream; returns an event marking its end
        (``None`` where the device has no events: the copy already happened)."""
        with self._mod.stream(self._side):
            dst.copy_(src, non_blocking=True)
            return self._side.record_event()


def _done(event: Any) -> None:
    if event is not None:
        event.synchronize()


def receive_staged(channel: Any, src: int, segments: SegmentPieces, meta: SnapshotMeta,
                   ring: StagingRing, what: str) -> None:
    """Receive ``segments``' pieces from ``src`` through ``ring`` into their (device)
    destination views, checking each segment's checksum against ``meta`` as its last
    piece lands; raises :class:`checksum.ChecksumMismatch` naming ``what``.

    Pieces are posted in order, at most ``RING_CHUNKS`` ahead of the one being
    consumed, so gloo matches them with the sender's pieces of the same tags."""
    flat = [(name, tag, dst) for name, pieces in segments for tag, dst in pieces]
    for dst in (d for _, _, d in flat):
        if dst.numel() > ring.chunk_bytes:
            raise ValueError(f"a piece of {dst.numel()} bytes exceeds the staging chunk")
    posted: collections.deque[tuple[object, torch.Tensor]] = collections.deque()
    copies: list[Any] = [None] * RING_CHUNKS  # the copy out of each ring chunk

    def post(i: int) -> None:
        _done(copies[i % RING_CHUNKS])  # that chunk's previous bytes are on the device
        copies[i % RING_CHUNKS] = None
        stage = ring.chunk(i, flat[i][2].numel())
        posted.extend(channel.post_recv_pieces([stage], src, flat[i][1]))

    for i in range(min(RING_CHUNKS, len(flat))):
        post(i)
    i = 0
    for name, pieces in segments:
        hasher = checksum.Hasher()
        for _ in pieces:
            work, stage = posted.popleft()
            channel.wait([work], what)
            hasher.update(stage)
            copies[i % RING_CHUNKS] = ring.copy(flat[i][2], stage)
            if i + RING_CHUNKS < len(flat):
                post(i + RING_CHUNKS)
            i += 1
        hasher.update(segment_trailer(meta.layout.segment(name), meta.skeletons[name]))
        if hasher.hexdigest() != meta.digests.get(name):
            raise checksum.ChecksumMismatch(
                f"{what} at step {meta.step}: segment {name!r} arrived with checksum "
                f"{hasher.hexdigest()}, sender recorded {meta.digests.get(name)}")
    for event in copies:
        _done(event)


def send_staged(channel: Any, dst: int, pieces: Sequence[tuple[int, torch.Tensor]],
                ring: StagingRing, what: str) -> None:
    """Send device ``pieces`` (gloo tag, source view) to ``dst`` through ``ring``,
    each staged to a host chunk first; returns once every send has ended (at most
    ``RING_CHUNKS`` are in flight: a chunk is reused only after its send ended)."""
    inflight: collections.deque[list] = collections.deque()
    for i, (tag, src) in enumerate(pieces):
        if len(inflight) == RING_CHUNKS:
            channel.wait(inflight.popleft(), what)
        stage = ring.chunk(i, src.numel())
        _done(ring.copy(stage, src))
        inflight.append(channel.post_send_pieces([stage], dst, tag))
    while inflight:
        channel.wait(inflight.popleft(), what)
