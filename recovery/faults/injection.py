"""Fault injection: kill, stop or raise on a chosen rank, at a chosen step and phase.

The syntax (``rank:step:phase[:kind]``, several joined by ``;``) is parsed in
:mod:`recovery.faults.spec`. Each fault fires once per job, decided by an atomic counter
in the store, so the replay of a rolled-back step does not fire it again. A
``snapshot`` or ``replication`` fault fires at the first snapshot at or after its step.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import torch
import torch.distributed as dist

from recovery.common.errors import InjectedFault
from recovery.common.events import Event
from recovery.faults.spec import FaultSpec
from recovery.generation.protocol import fault_key
from replication.replica_protocol.commit import committed_step

SNAPSHOT_PHASES = ("snapshot", "replication")
"""Phases reported only at snapshotted steps: a fault there fires at the first snapshot
at or after its step (``replication.every_n_steps: auto``, the default, chooses which
steps those are while the job runs), and its event names the step it fired at."""


class FaultInjector:
    """Fires this rank's faults when the runtime reports reaching their phase."""

    def __init__(self, specs: list[FaultSpec], rank: int, store: dist.Store, log=None,
                 committed: Callable[[], int] | None = None,
                 settle: Callable[[], None] | None = None) -> None:
        """``settle``: called before a kill or stop, to let what this rank has already
        sent reach its peers (its per-step marks, which leave in the background)."""
        self.specs = [s for s in specs if s.rank == rank]
        self.settle = settle
        self.store = store
        self.log = log
        # The committed step the log names: the runtime's (the store's record, or what
        # this rank learned when the record lags), else the store's.
        self.committed = committed or (lambda: committed_step(store))
        self.step = -1
        self._claimed: list[FaultSpec] = []

    def __bool__(self) -> bool:
        return bool(self.specs)

    def at(self, phase: str, step: int | None = None) -> None:
        step = self.step if step is None else step
        for spec in self.specs:
            if spec.phase == phase and spec not in self._claimed and self._due(spec, step):
                # Read before the claim: a store round trip between claiming and logging
                # let a node kill at the same step (another fault's) fall in between, and
                # a fault that fired went unrecorded (seen once in the CI soak).
                committed = self.committed() if self.log is not None else None
                self._claimed.append(spec)  # by this process or another: fires once
                if self._claim(spec):
                    self._fire(spec, step, committed)

    @staticmethod
    def _due(spec: FaultSpec, step: int) -> bool:
        """A ``recovery`` fault fires in the first recovery this rank enters from one step
        before its step on: a survivor may notice a failure at step S while it still
        finishes step S-1's round, or only once it has started S+1, so an exact match
        would leave the fault to timing (it did: 1 run in 5 missed it under load).
        A ``setup`` fault is due in the same recovery, after its rendezvous."""
        if spec.phase in ("recovery", "setup"):
            return step >= spec.step - 1
        if spec.phase in SNAPSHOT_PHASES:
            return step >= spec.step
        return step == spec.step

    def _claim(self, spec: FaultSpec) -> bool:
        return self.store.add(fault_key(str(spec)), 1) == 1

    def _fire(self, spec: FaultSpec, step: int, committed: int | None = None) -> None:
        if self.log is not None:
            at = step if spec.phase in SNAPSHOT_PHASES else spec.step  # where it fired
            self.log.emit(Event.FAULT_INJECTED, fault=str(spec), rank=spec.rank, step=at,
                          phase=spec.phase, kind=spec.kind, committed=committed)
        if spec.kind == "exception":
            raise InjectedFault(f"injected exception on rank {spec.rank} at step {spec.step} "
                                f"({spec.phase})")
        # A fault names a point in the step, not an instant: it comes after the marks
        # this rank posted have left (milliseconds, bounded by the caller). A rank
        # lost before its mark reached its holder is a case of its own (the recovery
        # then replays: tests/test_live_rollback.py).
        if self.settle is not None:
            self.settle()
        if spec.kind == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        if spec.kind == "node":
            try:
                os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.kill(os.getpid(), signal.SIGKILL)

    def install(self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None):
        """Hook the forward, backward and optimizer phases without touching user code."""
        if not self.specs:
            return
        phases = {s.phase for s in self.specs}
        if model is not None and "forward" in phases:
            model.register_forward_pre_hook(lambda *_: self.at("forward"))
        if model is not None and "backward" in phases:
            params = [p for p in model.parameters() if p.requires_grad]
            if params and hasattr(params[0], "to_local"):
                # FSDP2: autograd never sees the sharded parameters (their gradients are
                # assigned by a reduce-scatter), so no hook on them would fire; fire as the
                # root's backward starts, the peers then wait in its reduce-scatters.
                model.register_full_backward_pre_hook(lambda *_: self.at("backward"))
            elif params:
                params[0].register_hook(lambda g: (self.at("backward"), g)[1])
        if optimizer is not None and "optimizer" in phases:
            optimizer.register_step_pre_hook(lambda *_: self.at("optimizer"))
