"""The live-rollback rule of a recovery plan (ADR 0039).

A plan normally targets the newest committed step that every state still has a copy
of (:func:`recovery.generation.rendezvous.choose_plan`), and the job replays what came after it.
A data-parallel job can do better when the failure left the survivors' models and
optimizers as they were at the end of some step L (:mod:`replication.replica_protocol.marks`): every
rank then goes on from L itself, with nothing replayed. The planner upgrades its plan
to L when, and only when:

- every survivor reports the same live step L, newer than the plan's target (the
  committed step C; a survivor reports none when its large entries changed since its
  last mark, when it captured a snapshot after C other than L's, or when a durable save
  of C is still to be handed to its writer);
- every newcomer's mark of L is held by a survivor, which becomes its provider.

The upgraded plan keeps C as its ``base_step``: C's snapshots and replicas stay the
job's fallback until the next commit.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from recovery.generation.protocol import JoinRecord

if TYPE_CHECKING:
    from recovery.generation.rendezvous import RecoveryPlan


def upgrade(plan: RecoveryPlan, records: dict[int, JoinRecord]) -> RecoveryPlan | None:
    """``plan`` turned into a live rollback when the rule above allows; else ``None``."""
    survivors = [r for r in records.values() if not r.newcomer]
    steps = {r.live_step for r in survivors}
    if len(steps) != 1:
        return None
    live = steps.pop()
    if live <= plan.target_step or plan.target_step < 0:
        return None
    providers: dict[int, int] = {}
    for rank, rec in sorted(records.items()):
        if not rec.newcomer:
            continue
        holders = sorted(r.rank for r in survivors if r.marks.get(str(rank)) == live)
        if not holders:
            return None
        providers[rank] = holders[0]
    return dataclasses.replace(plan, target_step=live, providers=providers, live=True,
                               base_step=plan.target_step)

