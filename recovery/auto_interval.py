"""``replication.every_n_steps: auto`` in a running job: the policy, fed and agreed.

:mod:`recovery.interval_policy` decides; this adapter gives it what the runtime sees
and makes every rank apply the same interval, across recoveries too:

- the interval in force lives in the config object the replicator and the Lightning
  strategy read (``settings.replication.every_n_steps``, an int again once resolved),
  so the existing cadence (``step % every_n_steps``) applies it unchanged;
- it is also part of the training state (registered as ``_auto_interval``): a rollback
  restores the committed step's interval on every survivor, and a replacement receives
  it with the rest of its state, so no rank snapshots steps the others skip;
- choices are agreed at global steps every rank reaches (multiples of ``agree_every``):
  each rank proposes from its own measurements, the largest proposal wins (the rank
  that pays most decides, so none exceeds the budget) with one 8-byte all-reduce;
- each change is logged (an ``auto_interval`` event and, on rank 0, a console line)
  with the policy's reasons.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from recovery.events import Event
from recovery.interval_policy import Choice, IntervalPolicy

AGREE_EVERY = 64
"""Global steps between agreements (the probe's interval divides it)."""


class AutoInterval:
    """The runtime's side of ``every_n_steps: auto`` (see the module docstring)."""

    def __init__(self, settings: Any, rank: int, log: Any,
                 agree: Callable[[torch.Tensor], None]) -> None:
        """``agree(t)``: all-reduce ``t`` with MAX over the training group, waiting."""
        self.settings, self.rank, self.log, self.agree = settings, rank, log, agree
        self.policy = IntervalPolicy(budget=settings.replication.max_overhead,
                                     mtbf_s=settings.recovery.mtbf_s)
        settings.replication.every_n_steps = self.policy.probe_every
        self._t_prev: float | None = None
        self._last_step = -1

    @classmethod
    def from_settings(cls, settings: Any, rank: int, log: Any, state: Any,
                      agree: Callable[[torch.Tensor], None]) -> AutoInterval | None:
        """An adapter registered in ``state`` when the recipe says ``auto``, else None
        (a fixed number). Its entry is exempt from the replay check: a replayed step
        may measure other costs and agree on another interval, by design."""
        if settings.replication.every_n_steps != "auto":
            return None
        adapter = cls(settings, rank, log, agree)
        state.register("_auto_interval", adapter)
        state.exempt_from_replay_check("_auto_interval")
        return adapter

    # -- part of the training state: the interval in force ------------------------------
    def state_dict(self) -> dict[str, int]:
        return {"every_n_steps": int(self.settings.replication.every_n_steps)}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.settings.replication.every_n_steps = int(sd["every_n_steps"])
        self._t_prev = None  # a rollback: the next step's time includes the recovery

    # -- after every step --------------------------------------------------------------
    def after_step(self, step: int, snapshotted: bool, last_round: Any) -> None:
        now = time.perf_counter()
        if self._t_prev is not None and step == self._last_step + 1:
            rnd = (last_round.seal_s + last_round.transfer_s + last_round.commit_s
                   if snapshotted and last_round is not None else None)
            self.policy.observe(now - self._t_prev, snapshotted, rnd)
        self._t_prev, self._last_step = now, step
        if step % AGREE_EVERY:
            return
        local = self.policy.propose() if self.policy.probed else None
        proposal = torch.tensor([local.every_n_steps if local is not None else 0])
        self.agree(proposal)
        n = int(proposal.item())
        if n <= 0:
            return
        # Decide from the interval in force (the same on every rank, a replacement's
        # and a rolled-back rank's included), not from this rank's own history.
        self.policy.current = _in_force(self.policy.current,
                                        int(self.settings.replication.every_n_steps))
        choice = self.policy.adopt(n, local)
        if choice is None:
            return
        self.settings.replication.every_n_steps = choice.every_n_steps
        self.log.emit(Event.AUTO_INTERVAL, rank=self.rank, step=step,
                      every_n_steps=choice.every_n_steps, overhead=choice.overhead,
                      reasons=list(choice.reasons))
        if self.rank == 0:
            print(f"checkpointless: snapshot interval at step {step}: {choice.text}",
                  file=sys.stderr, flush=True)


def _in_force(cur: Choice | None, n: int) -> Choice:
    """The policy's choice, with the interval really in force (a rollback may have
    restored an older one, a replacement knows only the restored one)."""
    if cur is None:
        return Choice(n, 0.0, ("the interval in force",), n, None, 1)
    return cur if cur.every_n_steps == n else replace(cur, every_n_steps=n)
