"""Which committed snapshot the durable tier hands its writer when two rounds became
committed between two of its calls.

At a step's end ``maybe_snapshot`` waits for the round in flight (it becomes the
replicator's ``last_round``) and starts the next one; for a small state that next round
can end before ``persist_committed`` runs, so the newest settled round is already the
new one and the round just waited for was never seen committed. A save due at that
older step must not vanish silently:

* only the older one due: it is saved (the cadence a Lightning callback asked for);
* both due: the newest is saved and the older one has a ``skipped`` row that says why;
* at the job's end: both are saved, the older one first.

The rounds' bookkeeping is a stand-in (the object the tier reads: ``settled_round``,
``last_round``, the slots); the snapshot engine, the writer and its helper process are
real, writing to a temporary directory.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from recovery.durable.tier import DurableTier
from recovery.generation.protocol import EventLog
from recovery.recipe import load_config
from replication.durable import read_history
from replication.snapshots.snapshot import SnapshotEngine
from tests.test_durable_support import make_state, snapshot, train

pytestmark = pytest.mark.timeout(120)


class Rounds:
    """The part of a :class:`replication.replica_protocol.replicator.Replicator` the durable tier
    reads."""

    def __init__(self, engine: SnapshotEngine) -> None:
        self.engine = engine
        self.last_round: SimpleNamespace | None = None
        self.newest: SimpleNamespace | None = None

    def settled_round(self) -> SimpleNamespace | None:
        return self.newest or self.last_round

    def own_snapshot(self, step: int):
        return self.engine.slot_for(step)

    def hold_slot(self, slot, wait) -> None:
        self.engine.hold(slot, wait)

    def unhold_slot(self, slot, wait) -> None:
        self.engine.unhold(slot, wait)


def _tier(tmp_path, every: int) -> tuple[DurableTier, Rounds, dict]:
    settings = load_config(overrides=[f"persistence.path={tmp_path / 'ckpt'}",
                                      f"persistence.every_n_steps={every}",
                                      "persistence.keep_last=10"], env={})
    state, objs = make_state()
    tier = DurableTier(settings, rank=0, world_size=1, job_id="rounds", store=None,
                       log=EventLog(tmp_path / "events.jsonl", "test"), state=state,
                       committed_step=lambda: 0)
    engine = SnapshotEngine(state, shared_memory=True, num_slots=3)
    return tier, Rounds(engine), objs


def _commit_two(tier: DurableTier, rounds: Rounds, objs: dict, older: int, newer: int):
    """Steps ``older`` and ``newer`` captured; both rounds ended before the tier looks."""
    for step in (older, newer):
        train(objs)
        tier.before_capture(step)
        snapshot(rounds.engine, step)
    rounds.last_round, rounds.newest = SimpleNamespace(step=older), SimpleNamespace(step=newer)


def _rows(tmp_path) -> list[tuple[int, str]]:
    return sorted((int(r["step"]), r["status"]) for r in read_history(str(tmp_path / "ckpt")))


def test_the_waited_round_is_saved_when_only_it_is_due(tmp_path):
    tier, rounds, objs = _tier(tmp_path, every=2)
    try:
        _commit_two(tier, rounds, objs, 2, 3)  # 2 is due, 3 is not
        tier.persist_committed(rounds)
        assert tier.ticket is not None and tier.ticket.result(60).status == "ok"
        assert tier.persisted_step == 2
        tier.writer.flush(60)
    finally:
        tier.writer.close()
    assert _rows(tmp_path) == [(2, "ok")]


def test_both_due_saves_the_newest_and_records_the_older_as_skipped(tmp_path):
    tier, rounds, objs = _tier(tmp_path, every=1)
    try:
        _commit_two(tier, rounds, objs, 1, 2)
        tier.persist_committed(rounds)
        assert tier.ticket.step == 2 and tier.ticket.result(60).status == "ok"
        tier.writer.flush(60)
    finally:
        tier.writer.close()
    assert _rows(tmp_path) == [(1, "skipped"), (2, "ok")]
    (skip,) = [r for r in read_history(str(tmp_path / "ckpt")) if r["status"] == "skipped"]
    assert "superseded by step 2" in skip["detail"]


def test_the_final_call_saves_both(tmp_path):
    tier, rounds, objs = _tier(tmp_path, every=1)
    _commit_two(tier, rounds, objs, 1, 2)
    tier.finish(rounds)  # flushes, persists both, closes the writer
    assert _rows(tmp_path) == [(1, "ok"), (2, "ok")]
