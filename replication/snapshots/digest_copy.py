"""The segment checksum, and the copy that computes it in the same pass.

A snapshot's integrity rests on one definition, :func:`segment_digest`, which the
capture, the side channel, the durable tier and every restore must agree on, so it
lives in one place, with every way of producing or checking it: :func:`copy_and_digest`
hashes each chunk of a live tensor while it is in cache and then copies it into the
slot, so the source is read from DRAM once (:func:`copy_and_digest_steps` is the same
kernel cut into pieces, for a copy another thread may take over, see
:mod:`replication.snapshots.overlap`); :func:`compute_digests` and :func:`verify_segments` hash a
buffer that is already written.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

import torch

from replication.snapshots import checksum, streamcopy
from replication.snapshots.checksum import Hasher  # a name of its own: the bench's profile times it
from replication.snapshots.slots import SnapshotSlot
from replication.training_state.layout import FlatState, SegmentLayout, SnapshotLayout
from replication.training_state.snapshot_meta import SnapshotMeta

HASH_CHUNK = 1 << 20  # bytes of source hashed, then copied from cache, at a time


def segment_trailer(seg: SegmentLayout, skeleton: bytes) -> bytes:
    """What a segment's checksum covers after its buffer bytes: see :func:`segment_digest`."""
    return skeleton + b"\n" + seg.spec_bytes


def segment_digest(seg_bytes: torch.Tensor, seg: SegmentLayout, skeleton: bytes) -> str:
    r"""The checksum recorded for one segment in :attr:`SnapshotMeta.digests`.

    Defined as the hex xxh3-128 of the segment's buffer bytes (all ``seg.nbytes``,
    padding included, in buffer order) immediately followed by
    :func:`segment_trailer`: the skeleton bytes (``SnapshotMeta.skeletons[name]``, its
    UTF-8 JSON), one ``b"\n"``, then ``seg.spec_bytes`` (the compact JSON
    ``[seg.nbytes, [[dtype, shape, offset, nbytes], ...]]``). Tensor bytes alone are
    not enough: the skeleton holds the non-tensor state (step counters, learning
    rates) and the layout says which bytes form which tensor, and damage to either
    would otherwise restore silently. The trailer comes last so that a receiver can
    stream the segment's chunks through a :class:`checksum.Hasher` as they land and
    then ``update`` it with the trailer; compact JSON holds no raw newline, so the
    separator keeps skeleton and layout apart.
    """
    hasher = checksum.Hasher()
    hasher.update(seg_bytes)
    hasher.update(segment_trailer(seg, skeleton))
    return hasher.hexdigest()


def verify_as_they_land(
    pending: Sequence[tuple[str, Sequence[tuple[object, torch.Tensor]]]],
    meta: SnapshotMeta, wait: Callable[[object], None], what: str,
) -> None:
    """Check segments arriving over the network, hashing each chunk as soon as it lands.

    ``pending`` holds, per segment name, its chunks in buffer order, each paired with
    the work that fills it; ``wait(work)`` blocks until that chunk has arrived. The
    hashing overlaps the rest of the transfer, so verifying costs no pass of its own.
    A segment whose bytes, skeleton or layout differ from ``meta``'s checksum raises
    :class:`checksum.ChecksumMismatch` naming ``what`` and the segment.
    """
    for name, chunks in pending:
        hasher = Hasher()
        for work, chunk in chunks:
            wait(work)
            hasher.update(chunk)
        hasher.update(segment_trailer(meta.layout.segment(name), meta.skeletons[name]))
        if hasher.hexdigest() != meta.digests.get(name):
            raise checksum.ChecksumMismatch(
                f"{what} at step {meta.step}: segment {name!r} arrived with checksum "
                f"{hasher.hexdigest()}, sender recorded {meta.digests.get(name)}"
            )


def copy_and_digest(
    slot: SnapshotSlot,
    flat: FlatState,
    *,
    streaming: bool = True,
    already_copied: frozenset[int] = frozenset(),
) -> dict[str, str]:
    """Copy host tensors into ``slot`` and checksum each segment in the same pass.

    A large contiguous tensor goes in :data:`HASH_CHUNK` pieces: each piece of the
    *source* is hashed first, which brings it into cache, and is then copied from cache
    into the slot, with streaming stores where :mod:`replication.snapshots.streamcopy` has them
    (``streaming``). So the source is read from DRAM once and the slot is never pulled
    through the cache. Small or strided tensors are copied by torch and hashed from the
    slot in runs of at least one chunk. The digest covers the segment's bytes in buffer
    order, padding included, then its trailer (skeleton and layout), so it equals
    :func:`segment_digest` of the finished buffer when the copy is right; a copy that
    went wrong fails verification later, since the digest was taken from the source.

    ``already_copied`` holds positions in ``flat.tensors`` whose bytes are in the slot
    already (an overlapped capture copies them on the training thread, see
    :class:`PendingCopy`): they are hashed from the slot, not copied again.
    """
    steps = copy_and_digest_steps(slot, flat, streaming=streaming,
                                  already_copied=already_copied)
    while True:
        try:
            next(steps)
        except StopIteration as finished:
            return finished.value


def copy_and_digest_steps(
    slot: SnapshotSlot,
    flat: FlatState,
    *,
    streaming: bool = True,
    already_copied: frozenset[int] = frozenset(),
) -> Generator[None, None, dict[str, str]]:
    """:func:`copy_and_digest` one piece at a time: a generator that yields after each
    chunk or small tensor and returns the digests. A copy can so be handed from one
    thread to another between two pieces (:class:`PendingCopy`)."""
    assert slot.buffer is not None and slot.layout is not None
    stream = streaming and streamcopy.AVAILABLE
    digests: dict[str, str] = {}
    views, sources = slot.views, flat.tensors
    i = 0
    for seg in slot.layout.segments:
        seg_bytes = slot.buffer[seg.offset : seg.offset + seg.nbytes]
        hasher = checksum.Hasher()
        hashed = 0  # the segment's bytes up to here are in the hasher
        for spec in seg.tensors:
            dst, src = views[i], sources[i]
            i += 1
            if i - 1 in already_copied or spec.nbytes <= HASH_CHUNK or not src.is_contiguous():
                if i - 1 not in already_copied:
                    dst.copy_(src)
                end = spec.offset + spec.nbytes
                if end - hashed >= HASH_CHUNK:
                    hasher.update(seg_bytes[hashed:end])
                    hashed = end
                yield
                continue
            hasher.update(seg_bytes[hashed : spec.offset])  # pending small tensors, padding
            src_b = src.detach().reshape(-1).view(torch.uint8)
            src_view = checksum.tensor_bytes(src_b)
            dst_b = seg_bytes[spec.offset : spec.offset + spec.nbytes]
            src_at, dst_at = src_b.data_ptr(), dst_b.data_ptr()
            for off in range(0, spec.nbytes, HASH_CHUNK):
                n = min(HASH_CHUNK, spec.nbytes - off)
                hasher.update(src_view[off : off + n])
                if stream:
                    streamcopy.copy_bytes(dst_at + off, src_at + off, n)
                else:
                    dst_b[off : off + n].copy_(src_b[off : off + n])
                yield
            hashed = spec.offset + spec.nbytes
        hasher.update(seg_bytes[hashed:])
        hasher.update(segment_trailer(seg, flat.skeletons[seg.name]))
        digests[seg.name] = hasher.hexdigest()
    return digests


def compute_digests(
    buffer: torch.Tensor, layout: SnapshotLayout, skeletons: dict[str, bytes]
) -> dict[str, str]:
    """Per-segment checksums (:func:`segment_digest`) of a host buffer and its skeletons."""
    return {
        s.name: segment_digest(buffer[s.offset : s.offset + s.nbytes], s, skeletons[s.name])
        for s in layout.segments
    }


def verify_segments(
    buffer: torch.Tensor, meta: SnapshotMeta, names: list[str] | None = None
) -> None:
    """Raise :class:`checksum.ChecksumMismatch` naming the first corrupted segment.

    Each segment's bytes, skeleton and layout are checked (:func:`segment_digest`).
    """
    for seg in meta.layout.segments:
        if names is not None and seg.name not in names:
            continue
        got = segment_digest(
            buffer[seg.offset : seg.offset + seg.nbytes], seg, meta.skeletons[seg.name]
        )
        if got != meta.digests.get(seg.name):
            raise checksum.ChecksumMismatch(
                f"snapshot of step {meta.step}: segment {seg.name!r} checksum {got} "
                f"!= recorded {meta.digests.get(seg.name)}"
            )
