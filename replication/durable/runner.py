"""How the durable writer carries out one save: which path, and falling back.

:class:`~replication.durable.writer.DurableWriter` decides *whether* a step is saved
(schedule, one save at a time, bookkeeping); :class:`SaveRunner` does the save it hands
over, on one of three paths:

- in place (``Job.direct``): the helper process reads the snapshot straight from its
  shared-memory slot and verifies it before committing; a slot in private memory is
  written from the writer's thread;
- staged, in the helper: the writer's thread copies the snapshot into the shared staging
  buffer while the helper already writes what has been copied;
- staged, in-process: copy, then :class:`~replication.durable.saver.RankSaver` on the
  writer's thread.

It owns what those paths need (the helper's :class:`~replication.durable.worker.
ProcessBackend`, the in-process saver, the staging buffer), and gives up on the helper
for good, persisting from the thread instead, when it cannot start, never gets ready, or
finds no room for its shared staging buffer.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from replication.durable.format import persisted_digests, with_digests
from replication.durable.saver import (
    ABORTED,
    FAILED,
    RankSaver,
    SaveResult,
    SaverSettings,
    unverified,
)
from replication.durable.staging import StagingBuffer
from replication.durable.ticket import Job
from replication.snapshots.checksum import ChecksumMismatch
from replication.snapshots.slots import shared_keys, shared_location
from replication.training_state.snapshot_meta import SnapshotError, SnapshotMeta

if TYPE_CHECKING:
    from replication.durable.worker import ProcessBackend

log = logging.getLogger("checkpointless.durable")


class SaveRunner:
    """Runs the saves of one rank's writer, one at a time, on the writer's thread."""

    def __init__(self, settings: SaverSettings, abort: threading.Event) -> None:
        """``abort``: the writer's "abandon everything" flag (set by ``close``)."""
        self.settings = settings
        self.rank = settings.rank
        self.isolation = "thread"
        self.saver = RankSaver(settings)  # in-process saves, and cleanup
        self.backend: ProcessBackend | None = None
        self.staging = StagingBuffer()
        self._abort = abort
        self._warned_private = False

    def start(self, isolation: str) -> None:
        """Start the helper process (``isolation="process"``; it imports torch in the
        background) or get ready to persist from the writer's thread."""
        self.isolation = isolation
        if isolation == "process":
            from replication.durable.worker import ProcessBackend

            self.backend = ProcessBackend(self.settings)
            try:
                self.backend.start()  # imports torch in the background, off this process
            except OSError as exc:
                log.warning("durable writer of rank %d cannot start its helper process (%r); "
                            "writing from a thread instead", self.rank, exc)
                self.backend, self.isolation = None, "thread"
        if self.isolation == "thread":
            # DCP takes seconds to import: pay it here, not on the writer thread mid-training.
            import replication.durable.dcp_io  # noqa: F401

    def stop(self) -> None:
        """Stop the helper and free the staging buffer."""
        if self.backend is not None:
            self.backend.stop()
        self.staging.release()

    def run(self, job: Job) -> SaveResult:
        """Persist ``job``, releasing its ticket's buffer as soon as it is no longer read;
        the result's ``duration_s`` and ``cpu_s`` include staging."""
        step = job.meta.step
        t0, cpu0 = time.monotonic(), time.thread_time()
        n = job.meta.layout.nbytes
        if job.direct:
            result = self._run_direct(job)
        else:
            # Digests of the bytes as a loader will rebuild them (alignment padding
            # zeroed); read from the source's few padding bytes, so the save can start
            # before staging.
            meta = with_digests(job.meta, persisted_digests(job.buffer, job.meta))
            if self.staging.tensor is None or self.staging.nbytes < n:
                self._allocate_staging(n)
            if self.backend is not None and self.staging.shm is not None:
                result = self._run_in_helper(job, meta)
            else:
                try:
                    buf = self.staging.stage(job, None)
                except (ChecksumMismatch, SnapshotError) as exc:
                    return _unverified(step, self.rank, exc)
                finally:
                    job.ticket._release()
                result = self.saver.save(meta, buf, job.abort)
        result.duration_s = time.monotonic() - t0
        result.cpu_s += time.thread_time() - cpu0
        return result

    def _run_direct(self, job: Job) -> SaveResult:
        """Persist straight from the caller's buffer: no copy in this process when the
        buffer is in shared memory and the helper is up (it verifies the bytes itself,
        after writing them and before committing), else from this thread."""
        n = job.meta.layout.nbytes
        where = shared_location(job.buffer) if self.backend is not None else None
        if where is not None:
            assert self.backend is not None
            shm = self.staging.shm
            live = shared_keys() + ([shm.name] if shm is not None else [])
            result = self.backend.save(job.meta.to_bytes(), job.meta.step, None, n,
                                       offset=where.offset, fd=where.fd, key=where.key,
                                       verify=True, live=live)
            self._check_helper(result)
            return result
        if self.backend is not None and not self._warned_private:
            self._warned_private = True
            log.warning("durable writer of rank %d: the snapshot buffer is not in shared "
                        "memory; persisting it from a thread of the training process",
                        self.rank)
        return self.saver.save(job.meta, job.buffer[:n], job.abort, verify=True)

    def _run_in_helper(self, job: Job, meta: SnapshotMeta) -> SaveResult:
        """Staging and writing overlap: the helper starts serialising the first tensors
        while later ones are still being copied, and waits wherever it catches up.
        A segment counts as staged only once its copy has passed verification, so the
        helper can never finish (let alone commit) a step whose copy is bad."""
        shm = self.staging.shm
        assert self.backend is not None and shm is not None
        step, n = meta.step, meta.layout.nbytes
        progress = self.staging.progress
        assert progress is not None
        progress[0] = 0
        failure: list[str] = []  # a message, not the exception: its traceback pins buffers

        def stage() -> None:
            try:
                self.staging.stage(job, lambda end: progress.__setitem__(0, end))
            except (ChecksumMismatch, SnapshotError) as exc:
                failure.append(str(exc))
                raise
            finally:
                job.ticket._release()

        live = [*shared_keys(), shm.name]
        try:
            result = self.backend.save(meta.to_bytes(), step, shm.name, n, stage, live=live)
        except (ChecksumMismatch, SnapshotError):
            failure = failure or ["staging failed"]
        if failure:  # the helper was told to abandon the save
            self.saver.cleanup(step)
            return _unverified(step, self.rank, failure[0])
        self._check_helper(result)
        return result

    def _check_helper(self, result: SaveResult) -> None:
        """After a helper save: clean up after a helper that died mid-save, and give up
        on one that never started (persist from a thread from then on)."""
        assert self.backend is not None
        if result.status in (FAILED, ABORTED) and not self.backend.alive:
            self.saver.cleanup(result.step)  # the helper died mid-save
            if not self.backend.ever_ready and not self._abort.is_set():
                log.error("durable writer of rank %d: the helper process failed to start "
                          "(%s); persisting from a thread of the training process from "
                          "now on", self.rank, result.error)
                self._persist_from_thread()

    def _allocate_staging(self, n: int) -> None:
        self.staging.release()
        if self.backend is not None:
            if self.staging.allocate_shared(n):
                return
            log.warning("durable writer of rank %d: no room for a %d MB shared staging buffer "
                        "in /dev/shm; persisting from a thread of the training process",
                        self.rank, n >> 20)
            self._persist_from_thread()
        self.staging.allocate_private(n)

    def _persist_from_thread(self) -> None:
        """Give up on the helper process: stop it and persist from the writer's thread."""
        assert self.backend is not None
        self.backend.stop()
        self.backend, self.isolation = None, "thread"
        import replication.durable.dcp_io  # noqa: F401


def _unverified(step: int, rank: int, why: object) -> SaveResult:
    return SaveResult(step, rank, FAILED, error=unverified(why))
