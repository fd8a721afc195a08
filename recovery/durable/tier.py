"""The worker runtime's use of the durable tier: persist committed steps, restore one.

The durable tier is the fallback when every in-memory copy of some state is lost, and
the way a new job resumes an old one. Its storage format, writer and reader live in
``replication.durable``; this module is the runtime's side of it: *which* committed
snapshot to hand the writer and when (never waiting on I/O), and how every rank agrees
on one checkpoint and restores it (:mod:`recovery.durable.restore`). It was the
runtime's own "durable tier" section; it is a module of its own so that the runtime
only orchestrates.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from recovery.common.errors import RecoveryImpossible
from recovery.common.events import Event
from recovery.durable.restore import agree_and_read
from recovery.generation import protocol
from recovery.generation.rendezvous import RecoveryPlan
from recovery.recipe import CheckpointlessConfig
from recovery.schedules.save_schedule import SaveSchedule, crosses
from replication.replica_protocol.replicator import Replicator
from replication.snapshots.snapshot import restore_from_buffer
from replication.training_state.snapshot_meta import SnapshotError
from replication.training_state.state import TrainingState

log = logging.getLogger("checkpointless")


class DurableTier:
    """One rank's durable writer (when ``persistence.path`` and a schedule are set) and
    its restores. ``committed_step()`` reads the job's committed step."""

    def __init__(
        self, settings: CheckpointlessConfig, *, rank: int, world_size: int, job_id: str,
        store: dist.Store, log: protocol.EventLog, state: TrainingState,
        committed_step: Callable[[], int],
    ) -> None:
        self.settings = settings
        self.rank, self.world_size = rank, world_size
        self.store, self.log, self.state = store, log, state
        self._committed_step = committed_step
        self.writer = self._make_writer(job_id)
        # Which snapshot each save due by step count is made at (see
        # recovery.schedules.save_schedule): part of the training state, so every rank agrees.
        self.schedule: SaveSchedule | None = None
        if self.writer is not None and settings.persistence.every_n_steps:
            self.schedule = SaveSchedule()
            state.register("_save_schedule", self.schedule)
            state.exempt_from_replay_check("_save_schedule")  # auto may move snapshots
            state.mark_optional("_save_schedule")  # checkpoints of jobs without it load
        self.ticket: Any = None  # the last save handed to the writer
        self.persisted_step = -1
        self._never: set[int] = set()  # steps whose snapshot is not a save (see exclude)
        self.bytes_read = 0  # by the last restore
        # Seconds the last restore from storage took in this process (agree, read, load,
        # snapshot): the part of a restart from durable storage the run can measure.
        self.restore_s = 0.0

    def _make_writer(self, job_id: str) -> Any:
        p = self.settings.persistence
        if not p.path or not (p.every_n_steps or p.interval_s):
            return None
        from replication.durable import DurableWriter

        # zero_copy: the helper process persists straight from the snapshot slot (the
        # engine then keeps three slots in shared memory): no copy in this process.
        return DurableWriter(p, self.rank, self.world_size, run_id=job_id, zero_copy=True)

    @property
    def staging(self) -> bool:
        return bool(self.writer is not None and self.writer.staging)

    @property
    def zero_copy(self) -> bool:
        return bool(self.writer is not None and self.writer.zero_copy)

    # -- persisting ------------------------------------------------------------------
    def before_capture(self, step: int) -> None:
        """``step`` is about to be snapshotted: note it (the capture carries the note)."""
        if self.schedule is not None:
            self.schedule.before_capture(step)

    def persist_committed(self, replicator: Replicator, final: bool = False) -> None:
        """Hand the newest committed snapshot to the writer (never waits on I/O).

        Called at every step's end: the round in flight, once it has ended well, or the
        one ``maybe_snapshot`` last waited for (:meth:`Replicator.settled_round`); its
        step is committed and its slot protected until the capture after next.
        ``final``: the job's last committed step, persisted whether or not the schedule
        has it due.
        """
        newest, waited = replicator.settled_round(), replicator.last_round
        if newest is None:
            return
        # The round ``maybe_snapshot`` waited for at this step's end was not yet committed
        # at the previous one, and the round it then started may already have ended (a
        # small state): ``waited`` was never seen here. Its save, when due, is made if the
        # newest one is not. When both are due, the newest is saved and the older one
        # recorded as skipped (the writer cannot start both, and a wait here would stall
        # the loop), except at the job's end, which waits for the older one first.
        older = waited.step if waited is not None and waited.step < newest.step else None
        if older is not None and self._unhanded_and_due(older):
            assert self.writer is not None
            if final:
                self._persist(replicator, older, False)
                self.writer.flush(self.settings.replication.timeout_s)
            elif self._unhanded_and_due(newest.step):
                self.writer.skip(older, f"superseded by step {newest.step}: its round "
                                        "committed when the newer one had already ended")
            else:
                self._persist(replicator, older, False)
                return
        self._persist(replicator, newest.step, final)

    def _unhanded(self, step: int) -> bool:
        """Whether ``step`` may still be handed to the writer: newer than the last one
        handed (step 0 is the script's own initial state, or a checkpoint just restored:
        not worth the helper's start-up time, which would make the first real save
        skip), and not excluded."""
        return (self.writer is not None and step > max(self.persisted_step, 0)
                and step not in self._never)

    def _due(self, step: int) -> bool:
        assert self.writer is not None
        return bool(self.writer.should_persist(step, steps_due=self._due_by_steps(step)))

    def _unhanded_and_due(self, step: int) -> bool:
        """Whether ``step`` is a save due by the schedule not yet handed to the writer."""
        return self._unhanded(step) and self._due(step)

    def save_pending(self, step: int) -> bool:
        """Whether a save due at ``step`` was not handed to the writer yet: a live
        rollback past ``step`` would skip it, so it is not taken then (ADR 0039)."""
        if self.writer is None or step <= max(self.persisted_step, 0):
            return False
        return bool(self.writer.should_persist(step, steps_due=self._due_by_steps(step)))

    def exclude(self, step: int) -> None:
        """``step``'s snapshot is not one the schedule knows (the copy a live rollback
        takes of the step it went on from, ADR 0039): never a save, so a run with
        failures writes the checkpoints of one without."""
        self._never.add(step)

    def include(self, step: int) -> None:
        """Undo :meth:`exclude`: the capture that excluded ``step`` was discarded, and
        the job will run that step again."""
        self._never.discard(step)

    def after_recovery(self, replicator: Replicator, step: int) -> None:
        """The job was restored to its committed ``step``. A save due there that this
        rank had not handed to its writer yet (the failure came between the commit and
        the end of the next step) is made now, from the snapshot every rank holds after
        the handover, so a run with failures keeps the checkpoints of one without."""
        try:
            self._persist(replicator, step, False, wait_ready=False)
        except SnapshotError as exc:  # never fail a recovery for a save
            log.warning("durable save of step %d after the recovery skipped on rank %d: %s",
                        step, self.rank, exc)

    def _persist(self, replicator: Replicator, step: int, final: bool,
                 wait_ready: bool = True) -> None:
        if not self._unhanded(step) or not (final or self._due(step)):
            return
        assert self.writer is not None
        due = self._due_by_steps(step)
        slot = replicator.own_snapshot(step)
        assert slot.buffer is not None
        ticket = self.ticket = self.writer.submit(slot.meta(), slot.buffer,
                                                   wait_ready=wait_ready)
        self.persisted_step = step
        every = self.settings.persistence.every_n_steps
        self.log.emit(Event.DURABLE_SAVE, rank=self.rank, step=step, final=final,
                      due_step=step // every * every if every and due else None)
        writer, patience = self.writer, self.settings.replication.timeout_s

        def wait() -> None:  # a capture needs this very slot back
            if not ticket.wait_released(patience):
                writer.cancel(ticket)  # the previous checkpoint stays valid
                ticket.wait_released()

        # The slot must not be captured into until the writer is done reading it.
        replicator.hold_slot(slot, wait)
        ticket.released.add_done_callback(lambda _f: replicator.unhold_slot(slot, wait))

    def _due_by_steps(self, step: int) -> bool | None:
        """Whether a multiple of ``persistence.every_n_steps`` lies between the snapshot
        before ``step`` and ``step`` (None: no step schedule, or that snapshot is unknown,
        and the writer's own rule, an exact multiple, decides)."""
        every = self.settings.persistence.every_n_steps
        previous = self.schedule.previous(step) if self.schedule is not None else None
        if previous is None or not every:
            return None
        return crosses(previous, step, int(every))

    def finish(self, replicator: Replicator) -> None:
        """The final step, now committed, is always persisted, due or not (with
        ``every_n_steps: auto`` the last step is seldom a multiple of the interval, and
        a job resuming the run would repeat the steps since the last save): a save still
        in flight finishes first, or the writer would skip it as "cannot keep up"."""
        if self.writer is None:
            return
        self.writer.flush(self.settings.replication.timeout_s)
        self.persist_committed(replicator, final=True)
        self.writer.close()

    def drain(self, replicator: Replicator, step: int) -> int | None:
        """The job is stopping for its scheduler (:mod:`recovery.runtime.drain`): persist the
        committed ``step`` now and wait for it. Returns ``step`` once it is on storage,
        None without a writer, before any commit, or when the save failed."""
        if self.writer is None or step <= 0:
            return None
        patience = self.settings.replication.timeout_s
        self.writer.flush(patience)
        if step > self.persisted_step:
            try:
                self._persist(replicator, step, final=True)
            except SnapshotError as exc:  # this rank no longer holds the step
                log.warning("durable save of step %d at the stop skipped on rank %d: %s",
                            step, self.rank, exc)
        ticket = self.ticket
        self.writer.close(patience)
        if ticket is None or ticket.step != step:
            return None
        try:
            return step if ticket.result(0).status == "ok" else None
        except TimeoutError:
            return None

    # -- restoring -------------------------------------------------------------------
    def maybe_resume(self, replicator: Replicator) -> int | None:
        """A new job whose durable path holds checkpoints resumes from the newest valid
        one (``persistence.resume: auto``); returns its step, or ``None``."""
        p = self.settings.persistence
        if not p.path or p.resume != "auto":
            return None
        return self.restore(replicator, 0, Event.DURABLE_RESUME,
                            f"persistence.resume=auto and {p.path!r} holds checkpoints")

    def fall_back(self, replicator: Replicator, plan: RecoveryPlan,
                  reason: str) -> tuple[RecoveryPlan, int]:
        """In-memory recovery is impossible: every rank restores the newest durable
        checkpoint that all of them can verify (see :mod:`recovery.durable.restore`).
        Returns the plan to that step and the bytes read."""
        path = self.settings.persistence.path
        if not path:
            raise RecoveryImpossible(f"{reason}; persistence.path is not set, so there is no "
                                     "durable checkpoint to fall back to")
        step = self.restore(replicator, plan.gen, Event.DURABLE_FALLBACK, reason)
        if step is None:
            raise RecoveryImpossible(f"{reason}; and the durable tier at {path!r} holds no "
                                     "complete checkpoint yet")
        return RecoveryPlan(plan.gen, step, {}), self.bytes_read

    def restore(self, replicator: Replicator, gen: int, event: Event,
                reason: str) -> int | None:
        """Agree on a checkpoint, restore it, and make its step the committed one.

        Returns the restored step, or ``None`` when storage holds no checkpoint. The
        restored state is snapshotted and replicated at once (as step 0 is at start),
        so the next failure can again be recovered from memory.
        """
        committed_before, t0 = self._committed_step(), time.monotonic()
        got = agree_and_read(self.store, gen, self.rank, self.world_size,
                             self.settings.persistence,
                             lambda: protocol.current_generation(self.store))
        if got is None:
            return None
        choice, meta, buffer = got
        restore_from_buffer(self.state, buffer, meta)
        self.bytes_read = buffer.numel()
        del buffer
        replicator.snapshot(choice.step)
        replicator.wait()
        self.persisted_step = choice.step
        self.restore_s = time.monotonic() - t0
        lost = max(0, committed_before - choice.step) if committed_before >= 0 else 0
        self.log.emit(event, rank=self.rank, gen=gen, step=choice.step, path=choice.url,
                      reason=reason, skipped=choice.skipped, committed_before=committed_before,
                      steps_lost=lost, read_s=round(choice.read_s, 4))
        if self.rank == 0:
            skipped = "".join(f"; skipped step {s['step']} ({s['reason']})"
                              for s in choice.skipped)
            what = ("resuming" if event == Event.DURABLE_RESUME
                    else "falling back to durable storage")
            print(f"[checkpointless] {what}: {reason}; every rank restored step {choice.step} "
                  f"from {choice.url}{skipped}", file=sys.stderr, flush=True)
        return choice.step
