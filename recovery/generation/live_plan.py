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
- every newcomer's mark of L is held by a survivor, which becomes its provider;
- in a sharded job (ADR 0049), that survivor also holds the newcomer's replica of C
  and the unbroken run of its marks from C+1 to L, whose optimizer inputs the
  newcomer replays on that replica.

The upgraded plan keeps C as its ``base_step``: C's snapshots and replicas stay the
job's fallback until the next commit.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from recovery.generation.protocol import JoinRecord

if TYPE_CHECKING:
    from recovery.generation.rendezvous import RecoveryPlan


def upgrade(plan: RecoveryPlan, records: dict[int, JoinRecord]) -> RecoveryPlan:
    """``plan`` turned into a live rollback when the rule above allows; else ``plan``
    with ``live_refused`` saying why not (the recovery event's)."""
    live, why = _live(plan, records)
    return live if live is not None else dataclasses.replace(plan, live_refused=why)


def _live(plan: RecoveryPlan, records: dict[int, JoinRecord]) -> tuple[RecoveryPlan | None, str]:
    survivors = [r for r in records.values() if not r.newcomer]
    steps = {r.live_step for r in survivors}
    if len(steps) != 1:
        return None, f"the survivors' live steps differ: {sorted(steps)}"
    live = steps.pop()
    if live < 0:
        return None, "the survivors' state moved since their last mark (or they have none)"
    if live <= plan.target_step or plan.target_step < 0:
        return None, f"live step {live} is not newer than the committed step {plan.target_step}"
    logged = any(r.sharded for r in survivors)
    base = plan.target_step
    providers: dict[int, int] = {}
    for rank, rec in sorted(records.items()):
        if not rec.newcomer:
            continue
        holders = sorted(r.rank for r in survivors if r.marks.get(str(rank)) == live)
        if logged:  # and the unbroken log since the base, with the replica of the base
            holders = [h for h in holders if records[h].logs.get(str(rank), live + 1) <= base + 1
                       and base in records[h].replicas.get(str(rank), ())]
        if not holders:
            what = "update log" if logged else "mark"
            return None, (f"no survivor holds rank {rank}'s {what} from step "
                          f"{base + 1 if logged else live} to {live}")
        providers[rank] = holders[0]
    return dataclasses.replace(plan, target_step=live, providers=providers, live=True,
                               base_step=base, logged=logged), ""
