"""The durable writer's staging buffer: a paced, verified copy of a snapshot.

A writer that does not read the snapshot in place copies it first into a buffer of its
own, so the caller gets its snapshot slot back some 100 ms after ``submit``, before any
I/O. The copy is checked against the snapshot's segment digests as it goes
(:func:`copy_verified`): a slot overwritten or corrupted before the copy is never
persisted. When the writer has a helper process, the buffer lives in shared memory
(:class:`StagingBuffer`, behind a progress counter the helper waits on) so the helper can
start writing the first tensors while later ones are still being copied.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Callable
from multiprocessing import shared_memory

import numpy as np
import torch

from replication.durable.saver import STAGE_HEADER
from replication.durable.ticket import Job
from replication.snapshots.checksum import ChecksumMismatch, Hasher
from replication.snapshots.digest_copy import segment_trailer
from replication.training_state.snapshot_meta import SnapshotMeta

STAGE_CHUNK = 1 << 20  # copy-then-hash granularity: the chunk is hashed from L2
# Default pace of the staging copy: memory bandwidth is shared with training, and a copy
# spread over tens of milliseconds disturbs it far less than one burst at full speed
# (measured in benchmarks/bench_persist.py). Overlapped with serialisation, it barely
# lengthens a save; submit(release_within_s=...) speeds it up when the caller needs its
# buffer back sooner.
STAGE_BYTES_PER_S = 1.5e9


class StagingBuffer:
    """One writer's reusable staging buffer: private memory, or a shared-memory segment
    whose first ``STAGE_HEADER`` bytes count the bytes staged so far (for the helper)."""

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None
        self.shm: shared_memory.SharedMemory | None = None
        self.progress: np.ndarray | None = None  # over the shared segment's header

    @property
    def nbytes(self) -> int:
        """Host memory held (0 until the first save)."""
        return 0 if self.tensor is None else self.tensor.numel()

    def allocate_shared(self, n: int) -> bool:
        """Replace the buffer by a shared one of ``n`` bytes; False (and no buffer) when
        /dev/shm has no room for it."""
        self.release()
        shm = shared_buffer(STAGE_HEADER + n)
        if shm is None:
            return False
        self.shm = shm
        self.progress = np.frombuffer(shm.buf, dtype=np.int64, count=1)
        self.tensor = torch.frombuffer(shm.buf, dtype=torch.uint8, count=n, offset=STAGE_HEADER)
        return True

    def allocate_private(self, n: int) -> None:
        """Replace the buffer by one of ``n`` bytes in this process's memory."""
        self.release()
        self.tensor = torch.empty(n, dtype=torch.uint8)

    def stage(self, job: Job, on_progress: Callable[[int], None] | None) -> torch.Tensor:
        """Copy ``job``'s snapshot in, paced to be done by ``job.release_by`` (else at
        ``STAGE_BYTES_PER_S``); returns the staged bytes. Raises ``ChecksumMismatch``."""
        n = job.meta.layout.nbytes
        assert self.tensor is not None
        staged = self.tensor[:n]
        rate = STAGE_BYTES_PER_S
        if job.release_by is not None:
            left = job.release_by - time.monotonic()
            rate = 0.0 if left <= 0 else max(rate, n / (0.7 * left))  # 0: full speed
        copy_verified(staged, job.buffer[:n], job.meta, rate, on_progress)
        return staged

    def release(self) -> None:
        """Drop the buffer; a shared segment is closed and unlinked."""
        self.tensor = None
        self.progress = None
        if self.shm is not None:
            shm, self.shm = self.shm, None
            try:
                shm.close()
            except BufferError:  # a view still alive in a reference cycle
                gc.collect()
                with contextlib.suppress(BufferError):
                    shm.close()
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()


def shared_buffer(n: int) -> shared_memory.SharedMemory | None:
    """A shared-memory segment of ``n`` bytes with its pages reserved, or None.

    Reserving matters: /dev/shm is often small (64 MB in a default Docker container)
    and writing past its capacity kills the process with SIGBUS instead of an error.
    """
    try:
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize < n:
            return None
    except OSError:
        pass
    try:
        shm = shared_memory.SharedMemory(create=True, size=max(n, 1))
    except OSError:
        return None
    fd = getattr(shm, "_fd", -1)
    if fd >= 0 and hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, max(n, 1))
        except OSError:
            shm.close()
            shm.unlink()
            return None
    return shm


def copy_verified(
    dst: torch.Tensor,
    src: torch.Tensor,
    meta: SnapshotMeta,
    max_bytes_per_s: float = 0.0,
    on_progress=None,
) -> None:
    """Copy a snapshot buffer and check the copy against ``meta``'s segment digests.

    Each 1 MiB chunk is hashed right after it is copied, from cache (one pass over
    memory instead of two). A mismatch means the source changed or was corrupted before
    the copy: a caller that reused its buffer before ``released``, for instance.
    ``max_bytes_per_s`` spreads the copy out: a burst at full memory bandwidth slows a
    training loop on the same host far more than the same bytes moved over a few tens
    of milliseconds. ``on_progress(end)`` reports that ``dst[:end]`` is final (a
    segment's last chunk only once the whole segment has passed verification).
    """
    end = 0
    t0, done = time.monotonic(), 0
    for seg in meta.layout.segments:
        if seg.offset > end:
            dst[end : seg.offset].copy_(src[end : seg.offset])
        hasher = Hasher()
        seg_end = seg.offset + seg.nbytes
        for off in range(seg.offset, seg_end, STAGE_CHUNK):
            hi = min(off + STAGE_CHUNK, seg_end)
            dst[off:hi].copy_(src[off:hi])
            hasher.update(dst[off:hi])
            if on_progress is not None and hi < seg_end:
                on_progress(hi)
            done += hi - off
            if max_bytes_per_s:
                ahead = done / max_bytes_per_s - (time.monotonic() - t0)
                if ahead > 0.0005:
                    time.sleep(ahead)
        hasher.update(segment_trailer(seg, meta.skeletons[seg.name]))
        got = hasher.hexdigest()
        if got != meta.digests[seg.name]:
            raise ChecksumMismatch(
                f"snapshot of step {meta.step}: segment {seg.name!r} checksum {got} != "
                f"recorded {meta.digests[seg.name]}"
            )
        end = seg_end
        if on_progress is not None:
            on_progress(end)
    if dst.numel() > end:
        dst[end:].copy_(src[end:])
    if on_progress is not None:
        on_progress(dst.numel())
