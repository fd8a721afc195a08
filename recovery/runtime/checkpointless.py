"""The public worker runtime: make a plain PyTorch loop survive rank and node failures.

    cl = Checkpointless(model=model, optimizer=opt, scheduler=sched, loader=loader)
    def train_step(step):
        loss = model(next(batches)).mean()
        loss.backward()
        cl.all_reduce_gradients(model)
        opt.step(); opt.zero_grad(); sched.step()
    cl.run(train_step, num_steps=1000)

``run`` snapshots at the runtime's interval, replicated to other nodes and committed
through the store. When a rank fails, the survivors roll back from their own memory (or
go on from the live step), a replacement receives its state from a peer replica, the
process groups are rebuilt, and the step function never sees any of it.
"""

from __future__ import annotations

import atexit
import dataclasses
import faulthandler
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist

from recovery.common.causes import FailureCause, classify
from recovery.common.env import WorkerEnv
from recovery.common.errors import CollectiveAborted, FailureDetected, Fenced, RecoveryImpossible
from recovery.common.events import Event
from recovery.durable.tier import DurableTier
from recovery.engines import deepspeed_engine as ds_engine
from recovery.faults import divergence, user_errors
from recovery.faults.injection import FaultInjector
from recovery.faults.spec import FAULT_ENV, parse_faults
from recovery.generation import fencing, protocol, recovery_timeline, rendezvous, world
from recovery.generation.rendezvous import FRESH_START, GenerationChanged, RecoveryPlan, agree
from recovery.generation.status_records import record_recovered
from recovery.job_store import auth
from recovery.loader import loader_position
from recovery.process_group import controller, ddp_layout, device_placement, training_groups
from recovery.recipe import CheckpointlessConfig, worker_config
from recovery.resize import world_resize
from recovery.runtime import drain, gradient_average, live_rollback, progress_report
from recovery.runtime.epoch_loop import EpochLoop
from recovery.runtime.watchdog import Watchdog
from recovery.schedules.auto_interval import AutoInterval
from replication.replica_protocol.commit import UntrustedCommit, committed_step
from replication.replica_protocol.replicator import Replicator
from replication.side_channel.interruptible_store import StoreWaitInterrupted
from replication.side_channel.transport import WaitAbandoned, wait_polled
from replication.snapshots.memory import MemoryBudgetError
from replication.training_state.state import StateMismatch, TrainingState

#: Seconds a failure's declaration and teardown may take (milliseconds, normally)
#: before every thread's stack goes to stderr.
TEARDOWN_STALL_S = 15.0


class Checkpointless:
    """Registers the training state and runs the training loop recoverably."""

    def __init__(
        self,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        loader: Any = None,
        engine: Any = None,
        extra: dict[str, Any] | None = None,
        settings: CheckpointlessConfig | None = None,
        backend: str = "gloo",
        env: WorkerEnv | None = None,
        state: TrainingState | None = None,
        start: bool = True,
    ) -> None:
        """``engine``: a DeepSpeed engine, in place of ``model``, ``optimizer`` and
        ``scheduler`` (:mod:`recovery.engines.deepspeed_engine`). ``state`` replaces the
        default registry (integrations that restore through their own framework register
        stand-ins); ``start=False`` defers joining the job to :meth:`start`."""
        self.env = env or WorkerEnv.from_environ()
        device_placement.place(self.env.local_rank, model)  # LOCAL_RANK's GPU, unless chosen
        user_errors.refuse_unlaunched_multiprocess(self.env)
        self.settings = settings or worker_config(self.env.config_json)
        self.backend = backend
        self.rank, self.world_size = self.env.rank, self.env.world_size
        # The launch rank (as the agents name it) and world size: ADR 0035.
        self.slot = world.slot_of(os.environ) if self.env.launched else self.rank
        self.configured = int(os.environ.get(world.ENV_CONFIGURED_WORLD) or self.world_size)
        self.state = state if state is not None else TrainingState()
        entry = loader_position.track(loader) if loader is not None else None  # or refuse
        self.loop = EpochLoop(self, entry if entry is not loader else None)
        own_loop = self.loop if state is None else None  # frameworks keep their own loop
        if engine is not None:  # a DeepSpeed engine, taken apart into its entries
            (model, optimizer, scheduler), extra = ds_engine.entries(
                engine, self.state, extra, given=(model, optimizer, scheduler),
                saves=ds_engine.SaveHooks(lambda: self.gen, self.env.job_id, lambda **f: (
                    self.log.emit(Event.TAGGED_CHECKPOINT, **f)), lambda s: self.faults.at(
                    "save", s)))
        for name, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler),
                          ("scaler", scaler), ("loader", entry), ("_loop", own_loop),
                          *(extra or {}).items()):
            if obj is not None:
                self.state.register(name, obj)
        self.state.mark_optional("_loop")  # checkpoints of jobs without it load
        self._ddp_layouts = ddp_layout.track(self.state)  # DDP's buckets as the state's step
        self.log = protocol.EventLog(os.path.join(self.env.run_dir, "events.jsonl"),
                                     f"rank{self.rank}")
        self.auto_interval = AutoInterval.from_settings(  # every_n_steps: auto (either tier)
            self.settings, self.rank, self.log, self.state, lambda t: self.wait(
                dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)), lambda: self.gen)
        # Store values that fail the job-key check are ignored and reported here.
        auth.set_reporter(lambda **f: self.log.emit(Event.AUTH_REJECTED, rank=self.rank, **f))
        self.store = self._connect_store()
        self.world = world_resize.joined_world(self, entry)  # and the data it takes
        rec = self.settings.recovery
        fault_text = rec.fault or os.environ.get(FAULT_ENV, "")
        self.faults = FaultInjector(parse_faults(fault_text), self.rank, self.store, self.log,
                                    committed=lambda: self.committed_step,
                                    settle=lambda: live_rollback.marks_left(self))
        self.faults.install(model, optimizer)
        self.watchdog = Watchdog(  # its own connection: beats never queue behind the loop's
            self._connect_store() if self.env.launched else self.store,
            self.env.heartbeat_file, rec.heartbeat_interval_s,
            on_failure=lambda g: controller.controller().fail(
                f"generation {g} was declared (a failure elsewhere in the job)"),
            blocking=self.env.launched,
        )
        controller.controller().should_abort = lambda: self.watchdog.failure_pending
        self.progress = progress_report.attach(self)  # what the agent's metrics read
        self.gen = protocol.current_generation(self.store)
        self._created_group = False  # True: the runtime made the default group, not the script
        self.replicator: Replicator | None = None
        self.durable = DurableTier(
            self.settings, rank=self.rank, world_size=self.world_size, job_id=self.env.job_id,
            store=self.store, log=self.log, state=self.state,
            committed_step=lambda: self.committed_step)
        self.step = 0
        self._resumed_from: dict[str, Any] | None = None
        self._replay_warned = False  # one console warning per recovery (see _report_divergence)
        self._dp_checked: set[int] = set()  # models checked this generation (all_reduce_gradients)
        self._dp_entries: set[str] = set()  # state entries declared data-parallel (drift watch)
        self._transfer_parts: dict[str, float] = {}
        self._bytes_already_held = 0  # by the last handover's reseed: not sent
        self._repeats = user_errors.RepeatGuard()
        self._aborted_mark = CollectiveAborted.raised
        self._fence_mark = 0.0  # the engine's fence_wait_s at the last step event
        # Live rollback (ADR 0039): frameworks that hold outputs until their step commits
        # and expect a replay (the Lightning strategy) turn it off before start().
        self.live_rollback = self.settings.recovery.live_rollback
        self._joined_live: dict[str, Any] = {}  # what the last join record said of it
        self.watchdog.start(self.gen)
        # Registered first so it runs last: exit at once if abandoned gloo groups remain.
        training_groups.install_exit_guard()
        # Stop it before interpreter teardown destroys the store it polls under it.
        atexit.register(self.watchdog.stop)
        self.start_step, self._initial_snapshot = 1, True  # start() may say otherwise
        self._completed = 0  # the newest step this process completed (see replaying)
        self.restored_step: int | None = None  # set by start(): recovered or resumed step
        if start:
            self.start()

    def start(self, initial_snapshot: bool = True) -> int:
        """Join the job: a replacement (or a process of a later generation) recovers its
        state from a peer; a fresh one builds generation 0 and resumes from the durable
        tier or commits its initial state. Returns the first step to run.

        ``initial_snapshot=False`` leaves the initial commit to :meth:`commit_initial`,
        for frameworks that build their state after the process group exists.
        """
        self._initial_snapshot = initial_snapshot
        if self.env.replacement or self.gen > 0:
            # A process that ran its script again in a new world brings its snapshots.
            carried = world_resize.take_carried(self)  # its engine now serves this state
            self.replicator = carried  # type: ignore[assignment]  # held() until rebuilt
            fresh = carried is None
            self.restored_step = self._recover({"kind": FailureCause.REPLACEMENT},
                                               newcomer=fresh, declare=False)
        else:
            try:
                self._setup_generation(0)
            except RecoveryImpossible as exc:  # the job cannot start: stop it, say why
                self._fatal(str(exc))
            assert self.replicator is not None
            self.restored_step = self.durable.maybe_resume(self.replicator)
            self.step = self.restored_step or 0  # cl.epochs and cl.steps go on after it
            if self.restored_step is None and initial_snapshot:
                self.commit_initial(0)  # the initial state is step 0, committed first
        self.start_step = (self.restored_step or 0) + 1
        self.log.emit(Event.WORKER_READY, rank=self.rank, gen=self.gen, start_step=self.start_step,
                      replacement=self.env.replacement)
        return self.start_step

    def commit_initial(self, step: int) -> None:
        """Snapshot the state as ``step`` and wait until every copy holds it."""
        assert self.replicator is not None, "start() first"
        self.durable.before_capture(step)
        try:
            self.replicator.snapshot(step)
        except MemoryBudgetError as exc:  # the first capture allocates the slots
            self._fatal(str(exc))
        self.replicator.wait()

    # -- public API --------------------------------------------------------------------
    def run(self, train_step: Callable[[int], Any], num_steps: int) -> None:
        """Call ``train_step(step)`` for steps ``start_step..num_steps``, recoverably. The
        last step is always snapshotted, committed (a failure then rolls back like any
        other) and persisted with a durable tier (:meth:`DurableTier.finish`)."""
        step = self.start_step
        while True:
            try:
                while step <= num_steps:
                    self._before_step(step)
                    train_step(step)
                    self._after_step(step, True if step == num_steps else None)
                    step += 1
                self.wait_committed()  # the last step's round
                break
            except Exception as exc:  # any failure of a step or of the last commit
                step = self.recover(exc) + 1  # re-raises what cannot be recovered
        self._finish()

    def epochs(self, num_epochs: int) -> Iterator[int]:
        """``for epoch in cl.epochs(N):`` from the restored epoch (:mod:`.epoch_loop`)."""
        return self.loop.epochs(num_epochs)

    def steps(self, num_steps: int) -> Iterator[int]:
        """``for i in cl.steps(n):`` a pass of ``n`` steps, resumed at the right index."""
        return self.loop.steps(num_steps)

    def training_step(self) -> AbstractContextManager[int]:
        """``with cl.training_step():`` one step, recovered in place on a failure."""
        return self.loop.step()

    def all_reduce_gradients(self, model: torch.nn.Module) -> None:
        """Average gradients across ranks (deterministic order, failure-aware wait).

        Calling it declares ``model`` data-parallel, so the first call of each
        generation also checks that every rank holds the same weights."""
        gradient_average.all_reduce_gradients(self, model)

    def _declare_data_parallel(self, model: torch.nn.Module | None = None) -> None:
        """Watch for drift (:mod:`replication.replica_protocol.drift`) the data-parallel
        state entries: DDP modules, and ``model`` when given (the user all-reduces it)."""
        for name, obj in self.state:
            if obj is model or isinstance(obj, torch.nn.parallel.DistributedDataParallel):
                self._dp_entries.add(name)
        if self.replicator is not None:
            self.replicator.drift.watch(self._dp_entries)
            live_rollback.start_marks(self)
        world_resize.publish_resizability(self)  # whether the agents may shrink the job

    def wait(self, work: Any) -> None:
        """Wait for a collective, bailing out as soon as a failure is declared anywhere."""
        try:
            wait_polled(work, self.settings.recovery.collective_timeout_s,
                        lambda: self.watchdog.failure_pending)
        except WaitAbandoned as exc:
            raise FailureDetected("failure declared while in a collective") from exc
        except TimeoutError as exc:
            raise FailureDetected(f"collective timed out: {exc}") from exc
        except RuntimeError as exc:
            raise FailureDetected(f"collective failed: {exc}") from exc

    def replaying(self, step: int) -> bool:
        """Whether this process completed ``step`` before its last recovery: it runs again,
        bit-identical, and what it printed would print twice (a newcomer: False)."""
        return step <= self._completed

    @property
    def committed_step(self) -> int:
        try:
            return (self.replicator.committed_step() if self.replicator is not None
                    else committed_step(self.store))
        except UntrustedCommit as exc:  # every rank reads the same forged value
            raise RecoveryImpossible(f"cannot agree on a recovery target: {exc}") from None

    # -- the step API, for loops the runtime does not own (Lightning, NeMo) -------------
    def begin_step(self, step: int) -> None:
        """Start ``step``: raises :class:`FailureDetected` if a failure was declared."""
        self._before_step(step)

    def end_step(self, step: int, *, snapshot: bool | None = None) -> None:
        """``step`` is done: snapshot it (every ``replication.every_n_steps`` steps by
        default; always with ``snapshot=True``, never with ``False``), hand committed
        snapshots to the durable tier, log."""
        self._after_step(step, snapshot=snapshot)

    def wait_committed(self) -> None:
        """Block until the newest snapshot is committed on every copy (re-raises its
        round's failure): a framework then releases what only a committed step may show."""
        assert self.replicator is not None
        self.replicator.wait()

    def recover(self, exc: BaseException) -> int:
        """Recover in-process from ``exc`` (any failure of a step, local or remote).

        Returns the restored step (the newest committed one); the registered state
        holds it. Re-raises ``exc`` when recovery is impossible or disabled.
        """
        if isinstance(exc, RecoveryImpossible) or not isinstance(exc, Exception):
            raise exc
        if self.watchdog.stop_requested or drain.job_draining(self.store):
            drain.stop_for_scheduler(self)  # a peer left for the scheduler: no recovery
        if isinstance(exc, MemoryBudgetError):  # a replay would grow the state the same way
            self._fatal(str(exc))
        if not self.settings.recovery.enabled:
            raise exc
        cause = self._cause_of(exc)
        if cause["local"] and isinstance(exc, StopIteration):  # never a node's failure
            user_errors.stop_job(reason := user_errors.loop_ran_dry(self.rank, self.step, exc), exc)
            self._fatal(reason)
        if cause["local"] and self._repeats.repeated(exc, self.step):
            reason = (f"rank {self.rank} raised {user_errors.describe(exc)} at step {self.step} "
                      "again after recovering from it: a deterministic failure (a bug in "
                      "the step, or state the runtime does not know about), not retried")
            user_errors.stop_job(reason, exc)
            self._fatal(reason)
        return self._recover(cause)

    def finish(self, *, destroy_group: bool = True) -> None:
        """Training is over: wait for the last commit, persist it, tell the agent.

        ``destroy_group=False`` keeps the training process group for work the script
        still does after training (evaluation through a framework).
        """
        self._finish(destroy_group=destroy_group)

    # -- the step boundary -------------------------------------------------------------
    def _before_step(self, step: int) -> None:
        self.step = self.faults.step = step
        if self.watchdog.stop_requested:  # the scheduler stops the job (recovery.runtime.drain)
            drain.stop_for_scheduler(self)
        if self.watchdog.failure_pending:
            raise FailureDetected("a failure was declared by another participant")
        self.faults.at("step")

    def _after_step(self, step: int, snapshot: bool | None = None) -> None:
        assert self.replicator is not None
        self.state.check_step()  # e.g. a DeepSpeed step ended inside its accumulation
        user_errors.mark_first_step_done()
        self._completed = max(self._completed, step)
        if self.progress is not None:
            self.progress.step_done(step)
        # A slot the durable writer still reads is held (DurableTier.persist_committed).
        capture = self.replicator.snapshot_due(step) if snapshot is None else snapshot
        if capture:
            self.durable.before_capture(step)
        stall = self.replicator.snapshot(step) if capture else None
        live_rollback.mark(self, step)  # this step's small state, to the holders (ADR 0039)
        self.durable.persist_committed(self.replicator)
        if stall is not None:
            loader_position.mark_committed(self.state)
        self._report_divergence()
        if self._resumed_from is not None:
            info, self._resumed_from = self._resumed_from, None
            self.log.emit(Event.RESUMED, rank=self.rank, step=step,
                          resume_s=time.time() - info["recovered_at"], **info)
        # Waits of optimizer steps for an overlapped snapshot copy, since the last step.
        fenced = self.replicator.fence_wait_s
        fence_s, self._fence_mark = max(0.0, fenced - self._fence_mark), fenced
        if self.rank == 0:
            # the round that snapshot() just waited for (the previous snapshot's), if any
            rnd = self.replicator.last_round if stall is not None else None
            self.log.emit(Event.STEP, step=step, gen=self.gen, stall_s=stall, fence_s=fence_s,
                          replicated=dataclasses.asdict(rnd) if rnd is not None else None)
        if self.auto_interval is not None:
            self.auto_interval.after_step(step, stall is not None, self.replicator.last_round,
                                          self.durable)

    def _report_divergence(self) -> None:
        """Report drift and replay differences found since the last step
        (:func:`recovery.faults.divergence.report`); training goes on."""
        assert self.replicator is not None
        self._replay_warned = divergence.report(self.replicator, rank=self.rank, gen=self.gen,
                                                log=self.log, warned=self._replay_warned)

    def _finish(self, destroy_group: bool = True) -> None:
        assert self.replicator is not None
        self.replicator.wait()
        self._report_divergence()  # the last round sealed the last step
        self.durable.finish(self.replicator)  # the final step is always persisted
        protocol.mark_trained(self.store, self.slot, self.step)  # the agents name slots
        self.log.emit(Event.WORKER_DONE, step=self.step, gen=self.gen)
        # The watchdog beats until exit: a silent rank saving or evaluating looks hung.
        self.replicator.close()
        if destroy_group and self._created_group and dist.is_initialized():
            dist.destroy_process_group()  # the script's own group is the script's to destroy

    # -- generations -------------------------------------------------------------------
    def _connect_store(self) -> dist.Store:
        return self.env.connect_store()

    def _setup_generation(self, gen: int) -> None:
        rs = self.settings
        self._created_group |= training_groups.setup_training_group(
            self.store, gen, self.rank, self.world_size, rs.recovery.collective_timeout_s,
            self.backend, rs.recovery.ordered_allreduce, rs.recovery.nccl_fixed_algorithm,
        )
        old = self.replicator
        try:
            replicator = self._make_replicator(gen, old)
        except MemoryBudgetError as exc:
            # No generation can fix it: a replacement would need the same memory.
            raise RecoveryImpossible(str(exc)) from None
        self.replicator = replicator
        self._declare_data_parallel()
        self.gen = self.watchdog.generation = gen
        self._aborted_mark = CollectiveAborted.raised  # this generation's start

    def _make_replicator(self, gen: int, old: Replicator | None) -> Replicator:
        """This generation's replicator; snapshots and replicas carry over from ``old``."""
        rs = self.settings
        return Replicator(
            self.state, store=self.store, rank=self.rank, world_size=self.world_size,
            node=self.env.node, local_world_size=self.env.local_world_size,
            config=rs.replication, memory=rs.memory, prefix=protocol.gen_prefix(gen),
            previous=old,
            fault_hook=self.faults.at if self.faults else None,
            durable_staging=self.durable.staging, durable_zero_copy=self.durable.zero_copy,
            twins=getattr(old, "twins", ()),  # after a shrink (recovery.resize.world_resize)
            should_abort=lambda: self.watchdog.failure_pending,
        )

    def _teardown_generation(self) -> None:
        training_groups.fail_training_groups(f"generation {self.gen} failed")
        if self.replicator is not None:
            # Its sockets are shut down; a round thread still waiting for a commit in the
            # store (bounded by its timeout) holds the channel until then.
            training_groups.keep(self.replicator.abandon(), 5.0)

    def _cause_of(self, exc: Exception) -> dict[str, Any]:
        """This rank's own exception, or the consequence of a failure elsewhere
        (:func:`recovery.common.causes.classify`: by the exception's type, not its text)."""
        kind = classify(exc, self._failure_declared)
        return {"kind": kind, "rank": self.rank,
                "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                "local": kind is FailureCause.EXCEPTION}

    def _failure_declared(self) -> bool:
        """A failure is declared in the job, or a collective of this generation was
        aborted (see :class:`recovery.common.errors.CollectiveAborted`)."""
        return self.watchdog.failure_pending or CollectiveAborted.raised != self._aborted_mark

    def _recover(self, cause: dict[str, Any], newcomer: bool = False,
                 declare: bool = True) -> int:
        """Leave the failed generation, join the next one, restore; returns the step.
        ``newcomer``: it holds no state; ``declare=False``: it joins a generation that
        exists (a replacement, or a script run again in a new world with its snapshots)."""
        t_detect, failed_gen = time.time(), self.gen
        rec = self.settings.recovery
        self.log.emit(Event.FAILURE_DETECTED, rank=self.rank, gen=self.gen, step=self.step,
                      cause=cause)
        # Milliseconds, normally; if not, every thread's stack goes to the agent's log.
        faulthandler.dump_traceback_later(TEARDOWN_STALL_S, exit=False)
        try:
            if declare:
                protocol.declare_failure(self.store, self.gen, {**cause, "ts": t_detect})
            self._teardown_generation()
        finally:
            faulthandler.cancel_dump_traceback_later()
        t_abort = time.time()
        while True:
            # Checked on every pass: failures during a recovery make generations too;
            # a rank that finished training never joins one (rendezvous.finished_...).
            gen = protocol.current_generation(self.store)
            if over := (protocol.restart_budget_exceeded(self.store, rec.max_restarts)
                        or rendezvous.finished_while_training(self.store, gen, self.world.slots)):
                self._fatal(over)
            self.watchdog.generation = gen
            new_world = world.current(self.store, gen, self.configured)
            if new_world.slots != self.world.slots:  # the script runs again in it (ADR 0035)
                world_resize.leave(self, new_world, gen)
            try:
                self.faults.at("recovery", self.step)
                # One rank plans, every rank adopts its plan (or its impossible reason).
                (plan, impossible), t_rdzv = self._rendezvous(gen, newcomer), time.time()
                self.faults.at("setup", self.step)  # agreed; its groups not connected yet
                self._setup_generation(gen)
                t_pg = time.time()
                if impossible is None and plan.target_step == FRESH_START:
                    plan, moved = self._start_afresh(plan)
                elif impossible is None:
                    moved = self._transfer(plan)
                else:
                    plan, moved = self.durable.fall_back(self.replicator, plan, impossible)
                break
            except RecoveryImpossible as exc:
                self._fatal(str(exc))
            except Fenced as exc:
                fencing.leave(self.log, self.rank, self.gen, str(exc))
            except GenerationChanged:
                self._teardown_generation()
            except (MemoryBudgetError, StateMismatch) as exc:  # no retry helps: the state
                self._fatal(str(exc))  # grew past the budget, or this rank built it otherwise
            except Exception as exc:  # a failure during the recovery itself
                if isinstance(exc, (CollectiveAborted, StoreWaitInterrupted)) \
                        and self.watchdog.failure_pending:  # a newer generation ended
                    self._teardown_generation()  # this one's set-up (ADR 0043)
                    continue
                self.log.emit(Event.RECOVERY_INTERRUPTED, gen=gen, error=str(exc)[:300])
                protocol.declare_failure(self.store, gen, {
                    "kind": FailureCause.FAILURE_DURING_RECOVERY, "rank": self.rank,
                    "ts": time.time(), "error": str(exc)[:300]})
                self._teardown_generation()
        # Steps this survivor snapshotted after the target are replays from now on.
        self.replicator.rolled_back(plan.target_step)
        if not plan.live:  # a live rollback's step was committed in the handover
            self.durable.after_recovery(self.replicator, plan.target_step)
        self._replay_warned = False
        self._dp_checked.clear()
        t_reset = time.perf_counter()
        # a newcomer's objects are new: already fresh
        ddp_reset, fsdp_reset, pp_reset = training_groups.reset_parallel_modules(
            newcomer or not declare, ddps_rebuilt=self._ddp_layouts.take_restored())
        self._transfer_parts["reset_modules_s"] = round(time.perf_counter() - t_reset, 4)
        t_done = time.time()
        causes = [protocol.read_json(self.store, protocol.cause_key(g)) or {}  # the episode's
                  for g in range(gen if not declare else max(failed_gen + 1, gen - 7), gen + 1)]
        first = causes[-1]
        timings = recovery_timeline.phases(causes, t_detect, t_abort, t_rdzv, t_pg, t_done)
        info = {"gen": gen, "cause": first, "local_cause": cause, "target_step": plan.target_step,
                "live": plan.live, "base_step": plan.base_step if plan.live else plan.target_step,
                "logged": plan.logged, "live_refused": plan.live_refused,
                **self._joined_live,
                "fault_at": recovery_timeline.fault_at(causes, t_detect),
                "newcomers": plan.newcomers, "providers": plan.providers,
                "bytes_transferred": moved, "newcomer": newcomer, "timings": timings,
                "transfer_parts": self._transfer_parts,
                "bytes_already_held": self._bytes_already_held,
                "ddp_modules_reset": ddp_reset, "fsdp_modules_reset": fsdp_reset,
                "pipeline_schedules_reset": pp_reset, **controller.controller().counters(),
                "recovered_at": t_done}
        info["weighted_modules"] = world_resize.after_restore(self, plan.target_step)
        self.log.emit(Event.RECOVERY, rank=self.rank, **info)
        if self.rank == 0:  # for `checkpointless status`: what the incident cost
            record_recovered(self.store, gen, **recovery_timeline.outcome(info))
        self._resumed_from = info
        self.step = plan.target_step
        return plan.target_step

    def _rendezvous(self, gen: int, newcomer: bool) -> tuple[RecoveryPlan, str | None]:
        """Join ``gen`` and return its plan and the reason it is impossible (or None).
        The committed step is read by the planning rank only (``self.committed_step``:
        an untrusted record makes the plan impossible, on every rank alike)."""
        local, held = self.replicator.held() if self.replicator else ([], {})
        record = protocol.JoinRecord(
            rank=self.rank, node=self.env.node, pid=os.getpid(), newcomer=newcomer,
            local_steps=local, replicas={str(src): steps for src, steps in held.items()},
            committed=self.replicator.known_committed if self.replicator else -1,
            **live_rollback.join_fields(self, newcomer))
        self._joined_live = {"live_step": record.live_step, "marks_held": record.marks,
                             "logs_held": record.logs, "log_bytes": live_rollback.log_bytes(self)}
        timeout = max(60.0, 4 * self.settings.recovery.heartbeat_timeout_s)
        # A newer generation as the watchdog saw it (on its own connection, no request here)
        return live_rollback.rendezvous_capturing_ahead(self, record.live_step, lambda: agree(
            self.store, gen, record, self.world_size, timeout,
            lambda: max(self.watchdog.seen, gen), lambda: self.committed_step,
            self._fenced, blocking=True))

    def _fenced(self) -> str | None:
        return fencing.reason(self.store, self.slot, self.env.local_world_size, self.env.node)

    def _start_afresh(self, plan: RecoveryPlan) -> tuple[RecoveryPlan, int]:
        """Every process is new and nothing was committed: resume from storage or
        commit the script's initial state, as generation 0 does. Not for a framework
        that builds its state after the process group (``start(initial_snapshot=False)``):
        its state does not exist yet, so the job stops as before."""
        if not self._initial_snapshot:
            raise RecoveryImpossible("a failure happened before the first step was committed; "
                                     "there is no in-memory state to recover to")
        assert self.replicator is not None
        step = self.durable.maybe_resume(self.replicator)
        if step is None:
            self.commit_initial(0)
        return dataclasses.replace(plan, target_step=step or 0), 0

    def _transfer(self, plan: RecoveryPlan) -> int:
        """The handover to ``plan``'s target step (:meth:`Replicator.recover`); its parts'
        times go to ``self._transfer_parts``. Returns the bytes moved."""
        assert self.replicator is not None
        resharded = None if plan.live else world_resize.reshard(self, plan.target_step)
        if resharded is not None:
            return resharded  # FSDP2 state after the world changed size
        result = (live_rollback.transfer(self, plan) if plan.live  # ADR 0039
                  else self.replicator.recover(plan.target_step, plan.providers))
        self._transfer_parts, self._bytes_already_held = result.parts, result.skipped
        return result.moved

    def _fatal(self, reason: str) -> None:
        # The event first: the agent stops the workers as soon as the record is there
        self.log.emit(Event.FATAL, reason=reason)
        protocol.set_fatal(self.store, reason, rank=self.rank, gen=self.gen)
        raise RecoveryImpossible(reason)
