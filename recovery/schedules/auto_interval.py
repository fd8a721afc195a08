"""``every_n_steps: auto`` in a running job: the policies, fed and agreed.

:mod:`recovery.schedules.interval_policy` decides; this adapter gives it what the runtime sees
and makes every rank apply the same intervals, across recoveries too. It serves two
tiers, each when its recipe says ``auto``:

- ``replication.every_n_steps`` (ADR 0025): :class:`~recovery.schedules.interval_policy.
  IntervalPolicy`, fed every step's wall time and whether it was snapshotted;
- ``persistence.every_n_steps`` (ADR 0027): :class:`~recovery.schedules.interval_policy.
  SavePolicy`, fed every step's wall time, whether it was snapshotted, which durable
  save was in flight when it began, and every save's length (its ticket's
  ``busy_s``) once it ends. The save interval is always a multiple of the snapshot
  interval in force: saves are only ever of committed snapshots
  (:meth:`~recovery.durable.tier.DurableTier.persist_committed`).

For both:

- the interval in force lives in the config object the replicator, the durable writer
  and the Lightning strategy read (``settings.replication.every_n_steps``,
  ``settings.persistence.every_n_steps``, ints again once resolved), so the existing
  cadences (``step % every_n_steps``) apply it unchanged;
- it is also part of the training state (registered as ``_auto_interval``): a rollback
  restores the committed step's intervals on every survivor, and a replacement receives
  them with the rest of its state, so no rank snapshots, or persists, steps the others
  skip (a durable checkpoint is complete only when every rank wrote its step);
- choices are agreed at global steps every rank reaches (multiples of ``AGREE_EVERY``):
  each rank proposes from its own measurements, the largest proposal wins (the rank
  that pays most decides, so none exceeds the budget), with one all-reduce (MAX) of a
  two-element tensor: the snapshot interval and the save interval (0: no proposal);
- each change is logged (an ``auto_interval`` event naming its ``tier`` and, on rank 0,
  a console line) with the policy's reasons.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from recovery.common.events import Event
from recovery.schedules.interval_policy import (
    ASSUMED_MTBF_S,
    MAX_INTERVAL,
    Choice,
    IntervalPolicy,
    SavePolicy,
)

AGREE_EVERY = 64
"""Global steps between agreements (the probe's interval divides it)."""

REPLICATION, PERSISTENCE = "replication", "persistence"
"""The ``tier`` of an ``auto_interval`` event."""


class AutoInterval:
    """The runtime's side of ``every_n_steps: auto`` (see the module docstring)."""

    def __init__(self, settings: Any, rank: int, log: Any,
                 agree: Callable[[torch.Tensor], None],
                 failures: Callable[[], int] = lambda: 0) -> None:
        """``agree(t)``: all-reduce ``t`` with MAX over the training group, waiting;
        ``failures()``: failures the job has recovered from so far (its generation)."""
        self.settings, self.rank, self.log, self.agree = settings, rank, log, agree
        self.failures = failures
        self._t0 = time.monotonic()  # the job's start, as this rank knows it
        rep, per = settings.replication, settings.persistence
        self.policy: IntervalPolicy | None = None  # the snapshot interval's
        if rep.every_n_steps == "auto":
            self.policy = IntervalPolicy(budget=rep.max_overhead,
                                         mtbf_s=settings.recovery.mtbf_s)
            rep.every_n_steps = self.policy.probe_every
        self.saves: SavePolicy | None = None  # the durable save interval's
        if per.every_n_steps == "auto":
            if per.path:
                mtbf_s, note = durable_mtbf(settings)
                self.saves = SavePolicy(budget=per.max_overhead, mtbf_s=mtbf_s, mtbf_note=note)
                n = int(rep.every_n_steps)
                per.every_n_steps = -(-self.saves.probe_every // n) * n
            else:  # no durable tier (the recipe refuses this; a script's own settings may not)
                per.every_n_steps = 0
        self._t_prev: float | None = None
        self._last_step = -1
        self._seen: Any = None  # the newest durable save ticket seen
        self._tickets: list[Any] = []  # saves whose end is not counted yet
        self._saving: int | None = None  # the step being saved when the next step began
        # Steps of update log this rank can hold for its sources (ADR 0049; None: no
        # log): the snapshot interval is capped to what every rank can hold.
        self.log_steps: Callable[[], int | None] = lambda: None

    @classmethod
    def from_settings(cls, settings: Any, rank: int, log: Any, state: Any,
                      agree: Callable[[torch.Tensor], None],
                      failures: Callable[[], int] = lambda: 0) -> AutoInterval | None:
        """An adapter registered in ``state`` when the recipe says ``auto`` for either
        tier, else None (fixed numbers). Its entry is exempt from the replay check (a
        replayed step may measure other costs and agree on another interval, by design)
        and optional (a durable checkpoint of a job without it still resumes)."""
        if rank == 0:
            print(f"checkpointless: {startup_line(settings)}", file=sys.stderr, flush=True)
        if "auto" not in (settings.replication.every_n_steps,
                          settings.persistence.every_n_steps):
            return None
        adapter = cls(settings, rank, log, agree, failures)
        state.register("_auto_interval", adapter)
        state.exempt_from_replay_check("_auto_interval")
        state.mark_optional("_auto_interval")
        return adapter

    # -- part of the training state: the intervals in force -----------------------------
    def state_dict(self) -> dict[str, float]:
        sd: dict[str, float] = {"elapsed_s": time.monotonic() - self._t0}
        if self.policy is not None:
            sd["every_n_steps"] = int(self.settings.replication.every_n_steps)
        if self.saves is not None:
            sd["persist_every_n_steps"] = int(self.settings.persistence.every_n_steps)
        return sd

    def load_state_dict(self, sd: dict[str, float]) -> None:
        # A replacement learns how long the job has run (the MTBF estimate's time); a
        # survivor's own clock is already longer than the snapshot's.
        if "elapsed_s" in sd:
            self._t0 = min(self._t0, time.monotonic() - float(sd["elapsed_s"]))
        # A key is missing when the snapshot comes from a job whose tier was not auto.
        if self.policy is not None and "every_n_steps" in sd:
            self.settings.replication.every_n_steps = int(sd["every_n_steps"])
        if self.saves is not None and "persist_every_n_steps" in sd:
            self.settings.persistence.every_n_steps = int(sd["persist_every_n_steps"])
        if self.saves is not None:  # a multiple of the snapshot interval in force, always
            n, m = int(self.settings.persistence.every_n_steps), int(
                self.settings.replication.every_n_steps)
            self.settings.persistence.every_n_steps = -(-n // m) * m
        self._t_prev = None  # a rollback: the next step's time includes the recovery
        if self.policy is not None:
            self.policy.interrupted()

    # -- after every step --------------------------------------------------------------
    def after_step(self, step: int, snapshotted: bool, last_round: Any,
                   durable: Any = None) -> None:
        """``durable``: the runtime's :class:`~recovery.durable.tier.DurableTier`,
        called after it was handed this step's committed snapshot."""
        now = time.perf_counter()
        if self._t_prev is not None and step == self._last_step + 1:
            if self.policy is not None:
                rnd = (last_round.seal_s + last_round.transfer_s + last_round.commit_s
                       if snapshotted and last_round is not None else None)
                self.policy.observe(now - self._t_prev, snapshotted, rnd)
            if self.saves is not None:
                self.saves.observe(now - self._t_prev, snapshotted, self._saving)
        self._t_prev, self._last_step = now, step
        if self.saves is not None and durable is not None:
            self._follow_saves(durable)
        if step % AGREE_EVERY:
            return
        self._agree(step, durable)

    def _follow_saves(self, durable: Any) -> None:
        """Count the saves that ended (their length, skips), note the one in flight."""
        assert self.saves is not None
        writer = durable.writer
        if writer is None:
            return
        ticket = durable.ticket
        if ticket is not None and ticket is not self._seen:
            self._seen = ticket
            self._tickets = [*self._tickets[-7:], ticket]  # every ticket ends; bounded anyway
        for t in [t for t in self._tickets if t.done.done()]:
            self._tickets.remove(t)
            status = t.done.result().status
            self.saves.skipped += int(status == "skipped")
            self.saves.save_done(t.step, t.busy_s if status == "ok" else None)
        self._saving = writer.busy_step

    def mtbf(self) -> tuple[float, str]:
        """The MTBF the snapshot interval is chosen for, and where it came from:
        ``recovery.mtbf_s`` when set; else, once failures were seen, their observed rate
        (the job's time over their count, the rate's maximum-likelihood estimate);
        before that, :data:`~recovery.schedules.interval_policy.ASSUMED_MTBF_S` (ADR 0032)."""
        given = self.settings.recovery.mtbf_s
        if given:
            return float(given), " (recovery.mtbf_s)"
        k, elapsed = self.failures(), time.monotonic() - self._t0
        if k <= 0:
            return ASSUMED_MTBF_S, (" (assumed: no failure seen yet; recovery.mtbf_s "
                                    "sets it)")
        return max(elapsed / k, 1.0), f" (observed: {k} failure(s) in {elapsed:.0f} s)"

    def _agree(self, step: int, durable: Any) -> None:
        if self.policy is not None:
            self.policy.mtbf_s, self.policy.mtbf_note = self.mtbf()
        rep_local = (self.policy.propose()
                     if self.policy is not None and self.policy.probed else None)
        if self.saves is not None and durable is not None:
            self.saves.recovery_s = durable.restore_s
        save_local = self.saves.propose() if self.saves is not None else None
        # The third element: whether any rank's snapshot interval is its budget's (set
        # by a measured cost, so it shortens by halves at most: IntervalPolicy.adopt).
        fits = self.log_steps()
        proposal = torch.tensor([*(c.every_n_steps if c is not None else 0
                                   for c in (rep_local, save_local)),
                                 int(rep_local is not None and rep_local.budget_bound),
                                 -(MAX_INTERVAL if fits is None else fits)])  # MAX: least
        self.agree(proposal)
        n_rep, n_save, budget_bound, least = (int(x) for x in proposal.tolist())
        capped = False
        if self.policy is not None:  # an update log longer than memory holds: replays
            self.policy.max_interval = max(1, min(MAX_INTERVAL, -least))
            capped = 0 < self.policy.max_interval < n_rep
            if capped:  # the memory's bound, not a cost's: in force at once
                n_rep = self.policy.max_interval
                if rep_local is not None:
                    rep_local = replace(rep_local, reasons=(
                        *rep_local.reasons, f"capped at {n_rep} steps: the update logs "
                        "the memory budget holds (a longer interval would replay)"))
        # Decide from the intervals in force (the same on every rank, a replacement's
        # and a rolled-back rank's included), not from this rank's own history.
        rep = self.settings.replication
        if self.policy is not None and n_rep > 0:
            self.policy.current = _in_force(self.policy.current, int(rep.every_n_steps))
            choice = self.policy.adopt(n_rep, rep_local, budget_bound=bool(budget_bound),
                                       capped=capped)
            if choice is not None:
                rep.every_n_steps = choice.every_n_steps
                self._say(step, REPLICATION, choice)
        if self.saves is not None:  # after the snapshot interval: a multiple of it
            per = self.settings.persistence
            self.saves.current = _in_force(self.saves.current, int(per.every_n_steps))
            choice = self.saves.adopt(n_save, save_local, int(rep.every_n_steps))
            if choice is not None:
                per.every_n_steps = choice.every_n_steps
                self._say(step, PERSISTENCE, choice)

    def _say(self, step: int, tier: str, choice: Choice) -> None:
        extra: dict[str, Any] = {}
        if tier == PERSISTENCE and self.saves is not None:
            extra = {"save_s": round(self.saves.save_s or 0.0, 4),
                     "save_cost_s": round(self.saves.save_cost_s or 0.0, 5),
                     "skipped": self.saves.skipped}
        self.log.emit(Event.AUTO_INTERVAL, rank=self.rank, step=step, tier=tier,
                      every_n_steps=choice.every_n_steps, overhead=choice.overhead,
                      reasons=list(choice.reasons), **extra)
        if self.rank == 0:
            what = "snapshot interval" if tier == REPLICATION else "durable save interval"
            rework = f"; {replayed(choice.every_n_steps)}" if tier == REPLICATION else ""
            print(f"checkpointless: {what} at step {step}: {choice.text}{rework}",
                  file=sys.stderr, flush=True)


def replayed(every_n_steps: int) -> str:
    """What a failure costs in steps at this interval: the steps done since the newest
    committed snapshot are replayed, between none and ``n - 1`` of them, ``(n - 1) / 2``
    on average when failures land at random (plus the step the failure interrupted)."""
    n = max(1, int(every_n_steps))
    if n == 1:
        return "a failure replays no completed step"
    return f"a failure replays up to {n - 1} steps, {(n - 1) / 2:g} on average"


def startup_line(settings: Any) -> str:
    """The console line rank 0 prints at start-up: the snapshot interval and why, and
    what it means for a failure (ADR 0032). Under ``auto`` the interval is not known
    yet: the line says how it will be chosen and what the probe's steps run at."""
    rep = settings.replication
    live = ("; a data-parallel job whose model and optimizer the failure left untouched "
            "replays none (recovery.live_rollback)" if settings.recovery.live_rollback else "")
    if rep.every_n_steps != "auto":
        n = int(rep.every_n_steps)
        return (f"snapshot interval: every {n} step{'s' if n > 1 else ''} "
                f"(replication.every_n_steps={n}); {replayed(n)}{live}")
    probe = IntervalPolicy.probe_every  # the dataclass field's default
    mtbf = settings.recovery.mtbf_s
    job = (f"recovery.mtbf_s={mtbf:g} s" if mtbf else
           f"the job's MTBF (assumed {ASSUMED_MTBF_S / 3600:g} h until failures are seen, "
           "then their observed rate; recovery.mtbf_s sets it)")
    goal = (f"Daly's optimum for {job}, adding at most {rep.max_overhead:.1%} to a step "
            "while failures are rare (replication.max_overhead)")
    return (f"snapshot interval: auto: every {probe} steps while the first {AGREE_EVERY} "
            f"measure what a snapshot costs ({replayed(probe)}), then {goal}; "
            f"replication.every_n_steps=N fixes it{live}")


def durable_mtbf(settings: Any) -> tuple[float | None, str]:
    """The MTBF the durable save interval is chosen for, and a note on where it came
    from: ``persistence.mtbf_s`` (the time between losses memory cannot recover), else
    ``recovery.mtbf_s`` (between any failures: a lower bound of it, so Daly's interval
    for it is a lower bound of the right one, never past it), else None."""
    own, any_failure = settings.persistence.mtbf_s, settings.recovery.mtbf_s
    if own:
        return own, " between losses memory cannot recover"
    if any_failure:
        return any_failure, (" (recovery.mtbf_s: any failure, a lower bound of the time "
                             "between losses memory cannot recover)")
    return None, ""


def _in_force(cur: Choice | None, n: int) -> Choice:
    """The policy's choice, with the interval really in force (a rollback may have
    restored an older one, a replacement knows only the restored one)."""
    if cur is None:
        return Choice(n, 0.0, ("the interval in force",), n, None, 1)
    return cur if cur.every_n_steps == n else replace(cur, every_n_steps=n)
