"""The background writer of the durable tier.

``DurableWriter.submit(meta, buffer)`` hands a verified host snapshot to the writer
and returns at once with a :class:`PersistTicket`. The handshake:

- ``ticket.released`` completes when the writer no longer needs ``buffer``; the caller
  must not overwrite ``buffer`` until then (the runtime *holds* the snapshot slot,
  :meth:`~replication.snapshot.SnapshotEngine.hold`, so no capture writes into it
  before). Three ways to read it:

  * zero-copy (``zero_copy=True``, what the runtime uses): the helper process reads
    the snapshot straight from its slot, which the snapshot engine allocated in
    shared memory (:func:`~replication.slots.shared_location`; the descriptor is
    passed to the helper), and checks it against the snapshot's digests itself
    before committing. The training process does no work for the save; ``released``
    fires when the save is over, so the caller needs a spare slot (the runtime's
    engine keeps three). A buffer not in shared memory is written the same way from
    the writer's thread;
  * staging (the default): the writer's thread first copies the snapshot into its own
    reusable staging buffer (one paced memcpy, checked against the snapshot's digests
    chunk by chunk as it goes), so ``released`` fires some 100 ms after ``submit``,
    before any I/O; ``submit(release_within_s=...)`` hurries the copy, and makes a
    zero-copy writer stage that save too;
  * ``staging=False``: the writer's thread reads ``buffer`` directly (no extra memory;
    the slot is held for the whole write, and the save runs in-process).
- ``ticket.done`` completes with a :class:`SaveResult` when this rank's files are
  durable (or the save was skipped, failed or aborted). :meth:`DurableWriter.cancel`
  abandons a save that holds a buffer for too long.

``submit`` never waits for storage: it takes a lock and hands over a reference. If
the writer is still busy with an earlier step, the new step is skipped (logged, and
recorded in the history CSV) rather than queued: a store that cannot keep up must not
grow memory or stall training. Failed writes are retried with exponential backoff;
when every attempt fails the save is dropped with a loud error and training goes on.

Serialisation and I/O run in a helper process per rank by default
(``isolation="process"``, :mod:`replication.durable.worker`), reading the snapshot
slot or the staging buffer from shared memory, so ``torch.save``'s GIL-holding work
never competes with the training loop; ``isolation="thread"`` runs the same code
(:class:`~replication.durable.saver.RankSaver`) on the writer's thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np
import torch

from replication.checksum import ChecksumMismatch, Hasher
from replication.config import PersistenceConfig
from replication.digest_copy import segment_trailer
from replication.durable.format import persisted_digests, with_digests
from replication.durable.history import HistoryRow, HistoryWriter
from replication.durable.saver import (
    ABORTED,
    EXISTS,
    FAILED,
    OK,
    SKIPPED,
    STAGE_HEADER,
    RankSaver,
    SaveResult,
    SaverSettings,
    unverified,
)
from replication.slots import shared_keys, shared_location
from replication.snapshot_meta import SnapshotError, SnapshotMeta

log = logging.getLogger("checkpointless.durable")

TIER = "durable"
STAGE_CHUNK = 1 << 20  # copy-then-hash granularity: the chunk is hashed from L2
# Default pace of the staging copy: memory bandwidth is shared with training, and a copy
# spread over tens of milliseconds disturbs it far less than one burst at full speed
# (measured in benchmarks/bench_persist.py). Overlapped with serialisation, it barely
# lengthens a save; submit(release_within_s=...) speeds it up when the caller needs its
# buffer back sooner.
STAGE_BYTES_PER_S = 1.5e9
#: The longest a first save waits for the helper process to finish starting.
WARM_UP_TIMEOUT_S = 60.0

__all__ = ["DurableWriter", "PersistTicket", "SaveResult"]


class PersistTicket:
    """The caller's side of one :meth:`DurableWriter.submit`."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.released: Future[None] = Future()
        self.done: Future[SaveResult] = Future()

    def wait_released(self, timeout: float | None = None) -> bool:
        """Block until the writer is done with the submitted buffer; False on timeout."""
        try:
            self.released.result(timeout)
            return True
        except TimeoutError:
            return False

    def result(self, timeout: float | None = None) -> SaveResult:
        return self.done.result(timeout)

    def _release(self) -> None:
        if not self.released.done():
            self.released.set_result(None)

    def _finish(self, result: SaveResult) -> None:
        self._release()
        if not self.done.done():
            self.done.set_result(result)


@dataclass
class _Job:
    meta: SnapshotMeta
    buffer: torch.Tensor
    ticket: PersistTicket
    release_by: float | None = None  # time.monotonic() deadline for ``released``
    direct: bool = False  # read ``buffer`` in place (zero-copy or staging=False)
    abort: threading.Event = dataclasses.field(default_factory=threading.Event)


class DurableWriter:
    """Persists submitted snapshots of one rank in the background (see module docstring)."""

    def __init__(
        self,
        config: PersistenceConfig,
        rank: int,
        world_size: int,
        *,
        run_id: str | None = None,
        isolation: str = "process",
        staging: bool = True,
        zero_copy: bool = False,
        retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        progress_interval_s: float = 10.0,
        max_write_mbps: float = 0.0,
        prune: bool = True,
        clock=time.time,
    ) -> None:
        """``run_id`` names the job incarnation: a manifest is written only over done
        files that share it, so leftovers of a crashed earlier run never mix in (default:
        ``CHECKPOINTLESS_RUN_ID``, else ``TORCHELASTIC_RUN_ID``, else ``"default"``).
        ``isolation``: ``"process"`` (a helper process does the I/O) or ``"thread"``;
        ``staging=False`` implies ``"thread"``. ``zero_copy``: read submitted buffers in
        place (from shared memory in the helper), holding them until the save is over,
        with no staging buffer (see the module docstring). ``prune``: the rank that writes a
        manifest then applies ``config.keep_last``. ``max_write_mbps`` (0: unlimited)
        paces this rank's writes, to spare shared storage or the CPU of a small host."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        if isolation not in ("process", "thread"):
            raise ValueError(f"isolation must be 'process' or 'thread', got {isolation!r}")
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.run_id = run_id or os.environ.get("CHECKPOINTLESS_RUN_ID") or os.environ.get(
            "TORCHELASTIC_RUN_ID") or "default"
        self.staging = staging
        self.zero_copy = zero_copy
        self.isolation = isolation if staging else "thread"
        self._clock = clock
        self.enabled = bool(config.path)
        self._staging_buf: torch.Tensor | None = None
        self._shm: shared_memory.SharedMemory | None = None
        self._progress: np.ndarray | None = None
        self._cond = threading.Condition()
        self._pending: _Job | None = None
        self._current: _Job | None = None
        self._warned_private = False
        self._busy_step: int | None = None
        self._busy_since = 0.0
        self._rows: list[HistoryRow] = []
        self._closed = False
        self._abort = threading.Event()
        self._last_window: int | None = None
        self._skips_unlogged = 0
        self._last_skip_log = 0.0
        self.consecutive_failures = 0
        self.last_result: SaveResult | None = None
        self.newest_persisted_step = -1
        self.stats = {OK: 0, SKIPPED: 0, FAILED: 0, EXISTS: 0, ABORTED: 0, "committed": 0}
        self._thread: threading.Thread | None = None
        self._backend = None
        self.warm_up_s = 0.0  # what the first submit waited for the helper to be ready
        if not self.enabled:
            return
        self.settings = SaverSettings(
            path=config.path, storage_options=dict(config.storage_options), rank=rank,
            world_size=world_size, run_id=self.run_id, keep_last=config.keep_last,
            prune=prune, retries=retries, backoff_s=backoff_s, max_backoff_s=max_backoff_s,
            progress_interval_s=progress_interval_s, max_write_mbps=max_write_mbps,
        )
        self._saver = RankSaver(self.settings)  # in-process saves, and cleanup
        self.fs, self.root, self.url = self._saver.fs, self._saver.root, self._saver.url
        self._history = HistoryWriter(self.fs, self.root, rank)
        if self.isolation == "process":
            from replication.durable.worker import ProcessBackend

            self._backend = ProcessBackend(self.settings)
            try:
                self._backend.start()  # imports torch in the background, off this process
            except OSError as exc:
                log.warning("durable writer of rank %d cannot start its helper process (%r); "
                            "writing from a thread instead", rank, exc)
                self._backend, self.isolation = None, "thread"
        if self.isolation == "thread":
            # DCP takes seconds to import: pay it here, not on the writer thread mid-training.
            import replication.durable.dcp_io  # noqa: F401
        if config.every_n_steps <= 0 and config.interval_s <= 0 and rank == 0:
            log.warning("persistence.path is set but neither persistence.every_n_steps nor "
                        "persistence.interval_s: nothing is persisted unless forced")
        self._thread = threading.Thread(
            target=self._run, name=f"checkpointless-durable-r{rank}", daemon=True
        )
        self._thread.start()

    # -- schedule -------------------------------------------------------------------------
    def should_persist(self, step: int, now: float | None = None) -> bool:
        """Whether ``step`` is due: a multiple of ``every_n_steps`` (when set) and the
        first due step in its ``interval_s`` window (when set).

        Windows are aligned to the Unix epoch, so every rank takes the same decision
        for the same step without talking to the others (their clocks only need to agree
        to within the time between two steps' commits); a missed window is never
        carried over, which keeps ranks from drifting apart.
        """
        if not self.enabled or self._closed:
            return False
        n, s = self.config.every_n_steps, self.config.interval_s
        if n <= 0 and s <= 0:
            return False
        if n > 0 and step % n:
            return False
        if s > 0:
            return self._window(now) != self._last_window
        return True

    def _window(self, now: float | None) -> int:
        return int((self._clock() if now is None else now) // self.config.interval_s)

    def maybe_submit(
        self, meta: SnapshotMeta, buffer: torch.Tensor, release_within_s: float | None = None
    ) -> PersistTicket | None:
        """:meth:`submit` if :meth:`should_persist` says the step is due, else ``None``."""
        if not self.should_persist(meta.step):
            return None
        return self.submit(meta, buffer, release_within_s)

    # -- submit ---------------------------------------------------------------------------
    def submit(
        self, meta: SnapshotMeta, buffer: torch.Tensor, release_within_s: float | None = None
    ) -> PersistTicket:
        """Persist the snapshot ``(meta, buffer)`` in the background; never waits on I/O.

        ``buffer`` must stay unchanged until ``ticket.released`` completes. A zero-copy
        writer reads it until the save is over. Otherwise the staging copy runs at
        ``STAGE_BYTES_PER_S`` (about 85 ms per 128 MB); pass ``release_within_s`` (e.g.
        the time until the caller captures into this buffer again) to have it hurry
        when that would be too late (a zero-copy writer then stages this save).
        """
        ticket = PersistTicket(meta.step)
        if not self.enabled:
            ticket._finish(SaveResult(meta.step, self.rank, SKIPPED, error="persistence disabled"))
            return ticket
        if (
            buffer.device.type != "cpu"
            or buffer.dtype != torch.uint8
            or buffer.dim() != 1
            or not buffer.is_contiguous()
            or buffer.numel() < meta.layout.nbytes
        ):
            raise ValueError("submit needs the snapshot's contiguous host uint8 buffer "
                             f"of at least {meta.layout.nbytes} bytes")
        self._warm_up()
        now = time.monotonic()
        if self.config.interval_s > 0:
            self._last_window = self._window(None)
        with self._cond:
            if self._closed:
                reason = "writer is closed"
            elif self._busy_step is not None:
                reason = (f"still writing step {self._busy_step} ({now - self._busy_since:.1f}s "
                          "so far); storage cannot keep up")
            else:
                release_by = None if release_within_s is None else now + release_within_s
                direct = not self.staging or (self.zero_copy and release_by is None)
                self._pending = _Job(meta, buffer, ticket, release_by, direct)
                self._busy_step, self._busy_since = meta.step, now
                self._cond.notify_all()
                return ticket
            result = SaveResult(meta.step, self.rank, SKIPPED, error=reason)
            self._record(result)
            self._cond.notify_all()
        self._log_skip(result)
        ticket._finish(result)
        return ticket

    def _warm_up(self) -> None:
        """Before the first save, wait for the helper process to be ready.

        It has been starting since this writer was built (``import torch`` takes a second
        or two on a small host). A first save queued behind a starting helper counts
        that time as writing, and every save due meanwhile would be skipped as "storage
        cannot keep up" although storage is fast: a short job then persisted almost
        nothing. So the first submit waits, once, for what is left of the start-up.
        """
        backend = self._backend
        if backend is None or backend.ever_ready or self._busy_step is not None:
            return
        t0 = time.monotonic()
        ready = backend.wait_ready(WARM_UP_TIMEOUT_S)
        self.warm_up_s = time.monotonic() - t0
        if self.warm_up_s > 0.5 or not ready:
            log.info("durable writer of rank %d waited %.1fs for its helper process before "
                     "the first save%s", self.rank, self.warm_up_s,
                     "" if ready else " (not ready yet; the save waits for it)")

    def _log_skip(self, result: SaveResult) -> None:
        self._skips_unlogged += 1
        now = time.monotonic()
        if self._last_skip_log == 0.0 or now - self._last_skip_log >= 60.0:
            log.warning("durable checkpoint of step %d skipped on rank %d (%d skip(s) since "
                        "the last report): %s", result.step, self.rank, self._skips_unlogged,
                        result.error)
            self._last_skip_log, self._skips_unlogged = now, 0

    # -- lifecycle ------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until no save is pending or running; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._busy_step is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def cancel(self, ticket: PersistTicket, grace_s: float = 10.0) -> bool:
        """Abandon the save of ``ticket`` (it holds the caller's buffer for too long).

        The previous checkpoint stays valid; the save ends ``aborted``. A helper that
        does not stop within ``grace_s`` is killed (the next save restarts it). Returns
        whether the writer has released the buffer (a save on the writer's own thread
        may be stuck in a storage call that cannot be interrupted).
        """
        with self._cond:
            job = self._pending
            if job is not None and job.ticket is ticket:  # not started yet: drop it
                self._pending, self._busy_step = None, None
                result = SaveResult(ticket.step, self.rank, ABORTED, error="cancelled")
                self._record(result)
                self._cond.notify_all()
            else:
                job, result = self._current, None
        if result is not None:
            ticket._finish(result)
            return True
        if job is None or job.ticket is not ticket:
            return ticket.released.done()
        log.warning("durable writer of rank %d: cancelling the save of step %d, which holds "
                    "its snapshot buffer too long (the previous checkpoint stays valid)",
                    self.rank, ticket.step)
        job.abort.set()
        backend = self._backend
        if backend is not None:
            backend.abort_current()
            if not ticket.wait_released(grace_s):
                log.error("durable writer of rank %d: the helper did not stop within %.0fs; "
                          "killing it", self.rank, grace_s)
                backend.kill()
        return ticket.wait_released(grace_s)

    def close(self, timeout: float = 60.0) -> None:
        """Finish the save in flight (up to ``timeout``), then stop; aborts it after that."""
        with self._cond:
            if self._closed and self._thread is None:
                return
            self._closed = True
            self._cond.notify_all()
        if self._thread is None:
            return
        if not self.flush(timeout):
            log.warning("durable writer of rank %d: save of step %s still running after %.0fs; "
                        "aborting it (the previous checkpoint stays valid)", self.rank,
                        self._busy_step, timeout)
            self._abort.set()
            job = self._current
            if job is not None:
                job.abort.set()
            if self._backend is not None:
                self._backend.abort()
                if not self.flush(5.0):
                    self._backend.kill()
        self._thread.join(timeout=max(5.0, timeout))
        self._thread = None
        if self._backend is not None:
            self._backend.stop()
        self._release_staging()

    def __enter__(self) -> DurableWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def staging_bytes(self) -> int:
        """Host memory held by the staging buffer (0 until the first save)."""
        return 0 if self._staging_buf is None else self._staging_buf.numel()

    @property
    def busy(self) -> bool:
        return self._busy_step is not None

    # -- the writer thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._rows and not self._closed:
                    self._cond.wait()
                job, self._pending = self._pending, None
                self._current = job
                if job is not None and self._abort.is_set():
                    job.abort.set()
                rows, self._rows = self._rows, []
            self._history.append(rows)
            if job is None:
                # Decide under the lock: a save submitted just before close() (the final
                # step) may have arrived while the history was being written.
                with self._cond:
                    if self._closed and self._pending is None and not self._rows:
                        return
                continue
            try:
                result = self._process(job)
            except BaseException as exc:  # never let the thread die with a job unfinished
                log.exception("durable writer of rank %d crashed on step %d", self.rank,
                              job.meta.step)
                result = SaveResult(job.meta.step, self.rank, FAILED, error=repr(exc)[:300])
            if result.status == FAILED:
                self._fail_loudly(result)
            with self._cond:
                self._record(result)
                self._busy_step, self._current = None, None
                self._cond.notify_all()
            job.ticket._finish(result)

    def _record(self, result: SaveResult) -> None:
        """Bookkeeping and history row (call with ``_cond`` held)."""
        self.last_result = result
        self.stats[result.status] = self.stats.get(result.status, 0) + 1
        if result.committed:
            self.stats["committed"] += 1
        if result.status == OK:
            self.consecutive_failures = 0
            self.newest_persisted_step = max(self.newest_persisted_step, result.step)
        elif result.status == FAILED:
            self.consecutive_failures += 1
        self._rows.append(HistoryRow(
            time.time(), result.step, self.rank, TIER, result.nbytes, result.duration_s,
            result.status, result.error,
        ))

    def _fail_loudly(self, result: SaveResult) -> None:
        newest = self.newest_persisted_step
        log.error(
            "DURABLE CHECKPOINT FAILED: step %d on rank %d after %d attempt(s): %s. Training "
            "continues; this rank's newest persisted step is %s.%s", result.step, self.rank,
            result.attempts, result.error, newest if newest >= 0 else "none",
            f" {self.consecutive_failures + 1} saves in a row have failed: check the storage "
            f"at {self.url}." if self.consecutive_failures >= 2 else "",
        )

    def _process(self, job: _Job) -> SaveResult:
        step = job.meta.step
        t0, cpu0 = time.monotonic(), time.thread_time()
        n = job.meta.layout.nbytes
        if job.direct:
            result = self._process_direct(job)
        else:
            # Digests of the bytes as a loader will rebuild them (alignment padding
            # zeroed); read from the source's few padding bytes, so the save can start
            # before staging.
            meta = with_digests(job.meta, persisted_digests(job.buffer, job.meta))
            if self._staging_buf is None or self._staging_buf.numel() < n:
                self._allocate_staging(n)
            if self._backend is not None and self._shm is not None:
                result = self._process_in_helper(job, meta)
            else:
                try:
                    buf = self._stage(job, None)
                except (ChecksumMismatch, SnapshotError) as exc:
                    return _unverified(step, self.rank, exc)
                finally:
                    job.ticket._release()
                result = self._saver.save(meta, buf, job.abort)
        result.duration_s = time.monotonic() - t0
        result.cpu_s += time.thread_time() - cpu0
        return result

    def _process_direct(self, job: _Job) -> SaveResult:
        """Persist straight from the caller's buffer: no copy in this process when the
        buffer is in shared memory and the helper is up (it verifies the bytes itself,
        after writing them and before committing), else from this thread."""
        n = job.meta.layout.nbytes
        where = shared_location(job.buffer) if self._backend is not None else None
        if where is not None:
            assert self._backend is not None
            live = shared_keys() + ([self._shm.name] if self._shm is not None else [])
            result = self._backend.save(job.meta.to_bytes(), job.meta.step, None, n,
                                        offset=where.offset, fd=where.fd, key=where.key,
                                        verify=True, live=live)
            self._check_helper(result)
            return result
        if self._backend is not None and not self._warned_private:
            self._warned_private = True
            log.warning("durable writer of rank %d: the snapshot buffer is not in shared "
                        "memory; persisting it from a thread of the training process",
                        self.rank)
        return self._saver.save(job.meta, job.buffer[:n], job.abort, verify=True)

    def _check_helper(self, result: SaveResult) -> None:
        """After a helper save: clean up after a helper that died mid-save, and give up
        on one that never started (persist from a thread from then on)."""
        assert self._backend is not None
        if result.status in (FAILED, ABORTED) and not self._backend.alive:
            self._saver.cleanup(result.step)  # the helper died mid-save
            if not self._backend.ever_ready and not self._abort.is_set():
                log.error("durable writer of rank %d: the helper process failed to start "
                          "(%s); persisting from a thread of the training process from "
                          "now on", self.rank, result.error)
                self._backend.stop()
                self._backend, self.isolation = None, "thread"
                import replication.durable.dcp_io  # noqa: F401

    def _process_in_helper(self, job: _Job, meta: SnapshotMeta) -> SaveResult:
        """Staging and writing overlap: the helper starts serialising the first tensors
        while later ones are still being copied, and waits wherever it catches up.
        A segment counts as staged only once its copy has passed verification, so the
        helper can never finish (let alone commit) a step whose copy is bad."""
        assert self._backend is not None and self._shm is not None
        step, n = meta.step, meta.layout.nbytes
        progress = self._progress
        assert progress is not None
        progress[0] = 0
        failure: list[str] = []  # a message, not the exception: its traceback pins buffers

        def stage() -> None:
            try:
                self._stage(job, lambda end: progress.__setitem__(0, end))
            except (ChecksumMismatch, SnapshotError) as exc:
                failure.append(str(exc))
                raise
            finally:
                job.ticket._release()

        live = [*shared_keys(), self._shm.name]
        try:
            result = self._backend.save(meta.to_bytes(), step, self._shm.name, n, stage,
                                        live=live)
        except (ChecksumMismatch, SnapshotError):
            failure = failure or ["staging failed"]
        if failure:  # the helper was told to abandon the save
            self._saver.cleanup(step)
            return _unverified(step, self.rank, failure[0])
        self._check_helper(result)
        return result

    # -- staging --------------------------------------------------------------------------
    def _stage(self, job: _Job, on_progress) -> torch.Tensor:
        n = job.meta.layout.nbytes
        assert self._staging_buf is not None
        staged = self._staging_buf[:n]
        rate = STAGE_BYTES_PER_S
        if job.release_by is not None:
            left = job.release_by - time.monotonic()
            rate = 0.0 if left <= 0 else max(rate, n / (0.7 * left))  # 0: full speed
        copy_verified(staged, job.buffer[:n], job.meta, rate, on_progress)
        return staged

    def _allocate_staging(self, n: int) -> None:
        self._release_staging()
        if self._backend is not None:
            shm = _shared_buffer(STAGE_HEADER + n)
            if shm is not None:
                self._shm = shm
                self._progress = np.frombuffer(shm.buf, dtype=np.int64, count=1)
                self._staging_buf = torch.frombuffer(shm.buf, dtype=torch.uint8, count=n,
                                                     offset=STAGE_HEADER)
                return
            log.warning("durable writer of rank %d: no room for a %d MB shared staging buffer "
                        "in /dev/shm; persisting from a thread of the training process",
                        self.rank, n >> 20)
            self._backend.stop()
            self._backend, self.isolation = None, "thread"
            import replication.durable.dcp_io  # noqa: F401
        self._staging_buf = torch.empty(n, dtype=torch.uint8)

    def _release_staging(self) -> None:
        self._staging_buf = None
        self._progress = None
        if self._shm is not None:
            shm, self._shm = self._shm, None
            try:
                shm.close()
            except BufferError:  # a view still alive in a reference cycle
                gc.collect()
                with contextlib.suppress(BufferError):
                    shm.close()
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()


def _unverified(step: int, rank: int, why: object) -> SaveResult:
    return SaveResult(step, rank, FAILED, error=unverified(why))


def _shared_buffer(n: int) -> shared_memory.SharedMemory | None:
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
