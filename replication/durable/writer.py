"""The background writer of the durable tier.

``DurableWriter.submit(meta, buffer)`` hands a verified host snapshot to the writer
and returns at once with a :class:`PersistTicket`. The handshake:

- ``ticket.released`` completes when the writer no longer needs ``buffer``; the caller
  must not overwrite ``buffer`` until then (the runtime *holds* the snapshot slot,
  :meth:`~replication.snapshots.snapshot.SnapshotEngine.hold`, so no capture writes into it
  before). Three ways to read it:

  * zero-copy (``zero_copy=True``, what the runtime uses): the helper process reads
    the snapshot straight from its slot, which the snapshot engine allocated in
    shared memory (:func:`~replication.snapshots.slots.shared_location`; the descriptor is
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

This module decides *whether* and *when* a step is saved (schedule, one save at a time,
skips, results and the history CSV); the rest lives beside it: the caller's handle in
:mod:`~replication.durable.ticket`, the path a save takes (helper or thread, in place or
staged) in :mod:`~replication.durable.runner`, and the staging copy in
:mod:`~replication.durable.staging`.
"""

from __future__ import annotations

import logging
import threading
import time
from multiprocessing import shared_memory
from typing import TYPE_CHECKING

import torch

from replication import contract
from replication.config import PersistenceConfig
from replication.durable.history import HistoryRow, HistoryWriter
from replication.durable.runner import SaveRunner
from replication.durable.saver import (
    ABORTED,
    EXISTS,
    FAILED,
    OK,
    SKIPPED,
    SaveResult,
    SaverSettings,
)
from replication.durable.ticket import Job, PersistTicket
from replication.training_state.snapshot_meta import SnapshotMeta

if TYPE_CHECKING:
    from replication.durable.worker import ProcessBackend

log = logging.getLogger("checkpointless.durable")

TIER = "durable"
#: The longest a first save waits for the helper process to finish starting.
WARM_UP_TIMEOUT_S = 60.0

__all__ = ["DurableWriter"]


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
        the job's id, :func:`replication.contract.job_id`, else ``"default"``).
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
        self.run_id = run_id or contract.job_id() or "default"
        self.staging = staging
        self.zero_copy = zero_copy
        self._isolation = isolation if staging else "thread"
        self._clock = clock
        self.enabled = bool(config.path)
        self._runner: SaveRunner | None = None
        self._cond = threading.Condition()
        self._pending: Job | None = None
        self._current: Job | None = None
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
        self.warm_up_s = 0.0  # what the first submit waited for the helper to be ready
        if not self.enabled:
            return
        self.settings = SaverSettings(
            path=config.path, storage_options=dict(config.storage_options), rank=rank,
            world_size=world_size, run_id=self.run_id, keep_last=config.keep_last,
            prune=prune, retries=retries, backoff_s=backoff_s, max_backoff_s=max_backoff_s,
            progress_interval_s=progress_interval_s, max_write_mbps=max_write_mbps,
        )
        self._runner = SaveRunner(self.settings, self._abort)
        saver = self._runner.saver
        self.fs, self.root, self.url = saver.fs, saver.root, saver.url
        self._history = HistoryWriter(self.fs, self.root, rank)
        self._runner.start(self._isolation)
        if config.every_n_steps <= 0 and config.interval_s <= 0 and rank == 0:
            log.warning("persistence.path is set but neither persistence.every_n_steps nor "
                        "persistence.interval_s: nothing is persisted unless forced")
        self._thread = threading.Thread(
            target=self._run, name=f"checkpointless-durable-r{rank}", daemon=True
        )
        self._thread.start()

    # -- schedule -------------------------------------------------------------------------
    def should_persist(self, step: int, now: float | None = None, *,
                       steps_due: bool | None = None) -> bool:
        """Whether ``step`` is due: by step count (when ``every_n_steps`` is set) and
        the first due step in its ``interval_s`` window (when that is set).

        By step count, ``step`` is due when it is a multiple of ``every_n_steps``, or,
        when the caller knows the snapshot before it, ``steps_due``: a multiple lies in
        between (:mod:`recovery.schedules.save_schedule`: a save slips to the next snapshot
        instead of vanishing when its own step has none).

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
        if n > 0 and not (step % n == 0 if steps_due is None else steps_due):
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
        self, meta: SnapshotMeta, buffer: torch.Tensor, release_within_s: float | None = None,
        *, wait_ready: bool = True,
    ) -> PersistTicket:
        """Persist the snapshot ``(meta, buffer)`` in the background; never waits on I/O.

        ``buffer`` must stay unchanged until ``ticket.released`` completes. A zero-copy
        writer reads it until the save is over. Otherwise the staging copy runs at
        :data:`~replication.durable.staging.STAGE_BYTES_PER_S` (about 85 ms per 128 MB);
        pass ``release_within_s`` (e.g. the time until the caller captures into this
        buffer again) to have it hurry when that would be too late (a zero-copy writer
        then stages this save). ``wait_ready=False``: a first save does not wait for
        the helper process to finish starting (:meth:`_warm_up`), for a caller that must
        not stall, such as a recovery.
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
        if wait_ready:
            self._warm_up()
        now = ticket.submitted_at = time.monotonic()
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
                self._pending = Job(meta, buffer, ticket, release_by, direct)
                self._busy_step, self._busy_since = meta.step, now
                self._cond.notify_all()
                return ticket
            result = SaveResult(meta.step, self.rank, SKIPPED, error=reason)
            self._record(result)
            self._cond.notify_all()
        self._log_skip(result)
        ticket._finish(result)
        return ticket

    def skip(self, step: int, reason: str) -> SaveResult:
        """Record that the save due at ``step`` is not made, with ``reason``: a history
        row and a logged warning, as for a save the writer skipped itself, so a cadence
        that was not kept is never kept silently."""
        result = SaveResult(step, self.rank, SKIPPED, error=reason)
        with self._cond:
            self._record(result)
            self._cond.notify_all()
        self._log_skip(result)
        return result

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
        assert self._runner is not None
        self._runner.stop()

    def __enter__(self) -> DurableWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def staging_bytes(self) -> int:
        """Host memory held by the staging buffer (0 until the first save)."""
        return 0 if self._runner is None else self._runner.staging.nbytes

    @property
    def isolation(self) -> str:
        """Where saves run: ``"process"`` (the helper) or ``"thread"`` (also after giving
        up on a helper that could not start)."""
        return self._isolation if self._runner is None else self._runner.isolation

    @property
    def _backend(self) -> ProcessBackend | None:
        """The helper process's handle, while saves run there."""
        return None if self._runner is None else self._runner.backend

    @property
    def _shm(self) -> shared_memory.SharedMemory | None:
        """The shared staging segment (``None``: none, or a private staging buffer)."""
        return None if self._runner is None else self._runner.staging.shm

    @property
    def busy(self) -> bool:
        return self._busy_step is not None

    @property
    def busy_step(self) -> int | None:
        """The step being saved now (None: the writer is idle)."""
        return self._busy_step

    # -- the writer thread ------------------------------------------------------------------
    def _run(self) -> None:
        runner = self._runner
        assert runner is not None
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
                result = runner.run(job)
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
