"""The epoch-shaped loop people write, made recoverable: ``cl.epochs`` and ``cl.training_step``.

::

    for epoch in cl.epochs(2):            # starts at the restored epoch
        sampler.set_epoch(epoch)
        for batch in data:                # the user's own DataLoader, tracked
            with cl.training_step():      # one training step
                loss_fn(model(batch)).backward()
                opt.step(); opt.zero_grad()

``cl.training_step()`` runs one step: a failure inside it (a collective aborted, a rank's own
exception) is recovered on the spot, the exception is swallowed, and the loop goes on:
every registered object is back at the newest committed step, and the loader's tracked
iterator re-opens at the batch after it (:mod:`recovery.loader.loader_position`). A step that
ends normally is snapshotted on the usual cadence.

Python cannot rewind the script's own loops, so a rollback must never cross an epoch
boundary: the code between two passes (validation, a per-epoch scheduler, logging) and
the loop's epoch variable are the script's. Two rules guarantee it:

- the end of an epoch's last step is deferred to the first ``next()`` of the next pass,
  after the script's epoch-end code and the next epoch's ``set_epoch``: the snapshot
  there holds that state, as step ``S`` (the last step run), with the next pass not yet
  opened;
- that snapshot is committed before the pass opens (one replication round's wait per
  epoch), so every failure in the new epoch rolls back into it, never behind it.

What remains is said, not hidden: a failure in that one round per epoch, or in code
outside ``cl.training_step()``, is not replayed (the job stops, or in the first case
:class:`~recovery.common.errors.RecoveryImpossible` names the rule); with a loader that has no
length (an ``IterableDataset`` without ``__len__``) the last step of a pass cannot be
told and its end is not deferred, so a failure in the next epoch's first step stops
the job with the same line. ADR 0031.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from recovery.common.errors import RecoveryImpossible
from recovery.generation.protocol import PREFIX
from recovery.job_store import auth

if TYPE_CHECKING:
    from recovery.loader.loader_position import LoaderPosition
    from recovery.runtime.checkpointless import Checkpointless


class EpochLoop:
    """The loop's own state (the epoch), registered as ``_loop``; drives the passes of
    the tracked loader (:class:`~recovery.loader.loader_position.PassHooks`)."""

    def __init__(self, runtime: Checkpointless, position: LoaderPosition | None) -> None:
        self.rt, self.position = runtime, position
        self.epoch = 0
        self._deferred: int | None = None  # a step whose end waits for the next pass
        self.active = False  # inside cl.epochs(...)
        # cl.steps(n): the epoch of the counted pass and the step before its first one
        # (saved with the state, so a replacement resumes the pass at the right index).
        self._pass: tuple[int, int] | None = None
        self._counted: int | None = None  # n, while a cl.steps(n) pass runs
        if position is not None:
            position.hooks = self

    def state_dict(self) -> dict[str, int]:
        state = {"epoch": self.epoch}
        if self._pass is not None:
            state["pass_epoch"], state["pass_start"] = self._pass
        return state

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state.get("epoch", 0))
        self._pass = ((int(state["pass_epoch"]), int(state["pass_start"]))
                      if "pass_start" in state else None)
        self._deferred = None  # a restored state is a committed one: nothing pending

    # -- the epochs ------------------------------------------------------------------
    def epochs(self, num_epochs: int) -> Iterator[int]:
        """Yield the epochs from the restored one to ``num_epochs - 1``, then commit the
        final step and finish (with a durable tier, the final step is persisted).

        A failure while the final step commits rolls back like any other: the loop
        goes on from the restored epoch (the epoch's own code runs again for it, as in
        the failure-free run), and the final commit is tried again."""
        if num_epochs < 0:
            raise ValueError(f"cl.epochs: num_epochs must be >= 0, got {num_epochs}")
        self.active = True
        try:
            while True:
                while self.epoch < num_epochs:
                    yield self.epoch
                    self._check_epoch_end()
                    self.epoch += 1
                if self._commit_final():
                    break
        finally:
            self.active = False
        self.rt.finish()

    def _check_epoch_end(self) -> None:
        """Every rank ends an epoch at the same step, or the ranks ran different numbers
        of steps in it (a loop that counts steps itself, after a recovery): stop the
        job with the line that says so. The first rank to end the epoch records its step
        (one sealed compare-and-set per epoch and rank); a replay of the epoch's end
        after a rollback ends at the same step."""
        step = self._deferred if self._deferred is not None else self.rt.step
        won, agreed = auth.claim(self.rt.store, f"{PREFIX}/epoch_end/{self.epoch}", str(step))
        if not won and agreed != str(step):
            raise RecoveryImpossible(
                f"rank {self.rt.rank} ended epoch {self.epoch} at step {step}, and another "
                f"rank at step {agreed}: the ranks ran different numbers of steps in it. A "
                "loop that counts steps itself (`for _ in range(n):`) does not go back with "
                "a recovery; use `for i in cl.steps(n):` or iterate the loader "
                "(`for batch in loader:`)")

    def _commit_final(self) -> bool:
        """Commit the last step; False when a failure rolled the loop back before it."""
        step = self._deferred if self._deferred is not None else self.rt.step
        try:
            self._end_deferred(final=True)
            self.rt.wait_committed()
            return True
        except Exception as exc:
            return self.rt.recover(exc) >= step

    def before_pass(self) -> None:
        """A pass over the loader begins: the deferred end of the previous pass's last
        step happens now, committed before the pass opens."""
        if self._deferred is None:
            return
        step = self._deferred
        try:
            self._end_deferred(final=False)
            self.rt.wait_committed()
        except Exception as exc:  # the round of the boundary failed
            target = self.rt.recover(exc)
            if target < step:
                raise RecoveryImpossible(
                    f"a failure while the snapshot of step {step} (an epoch's end) was "
                    f"committed rolled the job back to step {target}, in the previous "
                    "epoch, which a loop that runs its own epochs cannot replay") from exc

    def _end_deferred(self, final: bool) -> None:
        step, self._deferred = self._deferred, None
        if step is not None:
            self.rt.end_step(step, snapshot=True)
        elif final and self.rt.step > 0 and not self.rt.replicator.snapshot_due(self.rt.step):
            self.rt.commit_initial(self.rt.step)  # the last step, which its cadence skipped

    # -- a pass the loop counts ---------------------------------------------------------
    def steps(self, num_steps: int) -> Iterator[int]:
        """``for i in cl.steps(n):`` the index of each step in a pass of ``n`` steps,
        ``0 .. n-1``, counted from the runtime's step rather than by the loop: after a
        recovery a survivor goes on at the index after the restored step, as a
        replacement does (the pass's first step is saved with the state). A loop's own
        ``range(n)`` goes on from where it was, and ranks then disagree on the pass.

        Inside ``cl.epochs`` it is one pass of the epoch, ended like a loader's pass:
        the last step's end is deferred to the next pass, and committed before it
        opens. Alone, it is the whole job: its last step is committed, and the runtime
        finishes, as ``cl.epochs`` does."""
        if num_steps < 0:
            raise ValueError(f"cl.steps: num_steps must be >= 0, got {num_steps}")
        if self._counted is not None:
            raise RuntimeError("cl.steps: a cl.steps() pass is already running (nested?)")
        if self.position is not None and self.active:
            self.position.begin_ahead()  # the boundary's snapshot holds the loader's pass
        self.before_pass()
        if self._pass is None or self._pass[0] != self.epoch:
            self._pass = (self.epoch, self.rt.step)  # a new pass (else: resumed mid-pass)
        self._counted = num_steps
        try:
            while True:
                while (index := self.rt.step - self._start()) < num_steps:
                    yield index
                if self.active or self._commit_final():
                    break
        finally:
            self._counted = None
        self._pass = None  # done: the deferred snapshot (if any) holds no open pass
        if not self.active:
            self.rt.finish()

    def _start(self) -> int:
        """The step before the counted pass's first. A restored state that holds no pass
        is from before it began (the job's initial state, or the epoch boundary's
        snapshot): the pass starts at the restored step, as it does for a replacement."""
        if self._pass is None:
            self._pass = (self.epoch, self.rt.step)
        return self._pass[1]

    def _at_pass_end(self, step: int) -> bool:
        """``step`` (just run) ends its pass: a counted pass's ``n``-th, or the tracked
        loader's last batch."""
        if self._counted is not None and self._pass is not None:
            return step - self._pass[1] >= self._counted
        return self.position is not None and self.position.at_pass_end()

    # -- one step --------------------------------------------------------------------
    @contextmanager
    def step(self) -> Iterator[int]:
        """One training step (see the module docstring); yields its number."""
        rt = self.rt
        step = rt.step + 1
        pending: Exception | None = None
        try:
            rt.begin_step(step)
        except Exception as exc:  # noticed before the step: the body's work is undone
            pending = exc
        try:
            yield step
        except Exception as exc:
            pending = exc
        if pending is None:
            if self.active and self._at_pass_end(step):
                self._deferred = step  # ended at the next pass (see before_pass)
                return
            try:
                rt.end_step(step)  # waits for the previous round: a failure shows here too
                return
            except Exception as exc:
                pending = exc
        rt.recover(pending)  # re-raises what cannot be recovered

