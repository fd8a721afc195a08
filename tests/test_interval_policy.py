"""The snapshot interval policy (recovery/schedules/interval_policy.py): pure arithmetic, no job."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch

from recovery.schedules.interval_policy import (
    IntervalPolicy,
    choose_interval,
    daly_interval_s,
)


def test_budget_gives_the_shortest_interval_within_it() -> None:
    # 10 ms added per snapshot on a 100 ms step: 1 step costs 10 %, 5 steps cost 2 %
    c = choose_interval(step_s=0.1, snapshot_cost_s=0.01, budget=0.02)
    assert c.every_n_steps == 5
    assert c.overhead == pytest.approx(0.02)
    assert "2.0% budget" in c.text and "no MTBF" in c.text
    # just over the boundary needs one more step
    assert choose_interval(step_s=0.1, snapshot_cost_s=0.0101, budget=0.02).every_n_steps == 6


def test_a_free_snapshot_is_taken_every_step() -> None:
    assert choose_interval(step_s=0.1, snapshot_cost_s=0.0).every_n_steps == 1
    # noise can make a measured cost negative: it counts as 0
    assert choose_interval(step_s=0.1, snapshot_cost_s=-0.003).every_n_steps == 1


def test_daly_interval_wins_when_longer_than_the_budgets() -> None:
    # cost 10 ms, MTBF 3 h: Daly's optimum ~ sqrt(2 * 0.01 * 10800) = 14.7 s = 147 steps
    c = choose_interval(step_s=0.1, snapshot_cost_s=0.01, budget=0.02, mtbf_s=3 * 3600)
    assert c.n_budget == 5
    assert c.every_n_steps == round((math.sqrt(2 * 0.01 * 10800) - 0.01) / 0.1)
    assert "Daly" in c.text
    # a short MTBF: Daly asks for fewer steps than the budget allows, and the budget's
    # interval would lose more than the budget to replays: Daly wins (ADR 0032)
    short = choose_interval(step_s=0.1, snapshot_cost_s=0.01, budget=0.02, mtbf_s=1.0)
    assert short.every_n_steps == 1 and "failures come so often" in short.text
    # a durable save keeps its budget as a ceiling
    save = choose_interval(step_s=0.1, snapshot_cost_s=0.01, budget=0.02, mtbf_s=1.0,
                           kind="save")
    assert save.every_n_steps == 5 and "the budget wins" in save.text


def test_daly_formula_and_its_limits() -> None:
    assert daly_interval_s(1.0, 5000.0) == pytest.approx(math.sqrt(2 * 5000) - 1)
    assert daly_interval_s(1.0, 5000.0, 100.0) == pytest.approx(math.sqrt(2 * 5100) - 1)
    assert daly_interval_s(30.0, 10.0) == 10.0  # a snapshot dearer than 2 MTBFs


def test_a_round_longer_than_the_interval_sets_the_minimum() -> None:
    c = choose_interval(step_s=0.1, snapshot_cost_s=0.0, round_s=0.35)
    assert c.every_n_steps == 4 and c.n_round == 4
    assert "round lasts" in c.text


def test_cap_and_bad_inputs() -> None:
    c = choose_interval(step_s=0.001, snapshot_cost_s=10.0, budget=0.02, max_interval=100)
    assert c.every_n_steps == 100 and "capped" in c.text
    with pytest.raises(ValueError):
        choose_interval(step_s=0.0, snapshot_cost_s=0.1)
    with pytest.raises(ValueError):
        choose_interval(step_s=0.1, snapshot_cost_s=0.1, budget=0.0)


def drive(policy: IntervalPolicy, steps: int, plain_s: float, cost_s: float,
          spill: float = 0.5, start: int = 1) -> list[int]:
    """Feed ``policy`` a synthetic run: a snapshot adds ``cost_s``, part of it to the
    snapshot step and ``spill`` of it to the step after (the round's CPU time).
    Returns the steps snapshotted."""
    snapped: list[int] = []
    carry = 0.0
    for i in range(start, start + steps):
        snap = policy.wants_snapshot()
        t = plain_s + carry + (cost_s * (1 - spill) if snap else 0.0)
        carry = cost_s * spill if snap else 0.0
        policy.observe(t, snap)
        if snap:
            snapped.append(i)
        if policy.due():
            local = policy.propose()
            assert local is not None
            policy.adopt(local.every_n_steps, local)
    return snapped


def test_policy_probes_then_learns_the_cost_and_picks_the_interval() -> None:
    p = IntervalPolicy(budget=0.02, probe_every=8, probe_steps=48)
    snapped = drive(p, 48, plain_s=0.1, cost_s=0.01)
    assert snapped == list(range(8, 49, 8))  # the probe's interval
    assert p.plain_step_s == pytest.approx(0.1)
    assert p.snapshot_cost_s == pytest.approx(0.01)
    assert p.every_n_steps == 5
    snapped = drive(p, 40, plain_s=0.1, cost_s=0.01, start=49)
    assert len(snapped) >= 7 and all(b - a == 5 for a, b in pairwise(snapped))
    assert p.snapshot_cost_s == pytest.approx(0.01)  # whole intervals keep measuring it


def test_policy_reevaluates_when_costs_change_and_ignores_noise() -> None:
    p = IntervalPolicy(budget=0.02, reeval_steps=50, window=4)
    drive(p, 48 + 100, plain_s=0.1, cost_s=0.01)
    assert p.every_n_steps == 5
    drive(p, 600, plain_s=0.1, cost_s=0.04, start=149)  # four times dearer: longer at once
    assert p.every_n_steps == 20
    drive(p, 600, plain_s=0.1, cost_s=0.034, start=749)  # 17 steps would do: within the
    assert p.every_n_steps == 20  # hysteresis, kept
    drive(p, 600, plain_s=0.1, cost_s=0.01, start=1349)  # clearly cheaper again
    assert p.every_n_steps == 5


def test_a_cost_measured_at_a_long_interval_shortens_it_by_halves_only() -> None:
    """A round whose work fits in the idle time of a long interval costs nothing
    measurable there, and may cost much at a short one (seen in the recovery benchmark:
    a 200 MB round every 8 steps cost nothing on 2 cores, every step 19 % of the step).
    Taken at its word, the zero cost said "every step". The budget's interval now at
    most halves per re-evaluation, and a cost measured at the shorter interval pushes it
    back at once: the job never snapshots every step, and spends at most one
    re-evaluation period in three at an interval where the rounds no longer fit."""
    p = IntervalPolicy(budget=0.02, probe_every=8, probe_steps=48, reeval_steps=48, window=4)
    at: list[int] = []
    for _ in range(48 * 12):
        n = p.every_n_steps
        snap = p.wants_snapshot()
        p.observe(0.1 + (0.03 if snap and n < 4 else 0.0), snap)  # fits in 4 steps or more
        at.append(n)
        if p.due():
            local = p.propose()
            assert local is not None
            chosen = p.adopt(local.every_n_steps, local)
            if chosen is not None and chosen.every_n_steps < n:
                assert chosen.every_n_steps >= -(-n // 2), chosen.text
                assert "at most halved" in chosen.text or chosen.every_n_steps * 2 >= n
    assert min(at) >= 2, sorted(set(at))
    assert sum(n < 4 for n in at) <= len(at) / 3, sorted(set(at))


def test_adopt_takes_the_agreed_interval_and_says_so() -> None:
    p = IntervalPolicy(probe_every=4, probe_steps=8, settle_steps=2)
    for i in range(1, 9):
        snap = p.wants_snapshot()
        assert snap == (i % 4 == 0)
        p.observe(0.1 + (0.01 if snap else 0.0), snap)
    assert p.due()
    local = p.propose()
    assert local is not None and local.every_n_steps == 5
    chosen = p.adopt(9, local)  # another rank measured more
    assert chosen is not None and chosen.every_n_steps == 9
    assert "another rank" in chosen.text
    assert not p.due()


# -- the recipe: every_n_steps accepts 'auto', with max_overhead and recovery.mtbf_s -------
def test_recipe_accepts_auto_and_the_budget(tmp_path) -> None:
    from recovery.recipe import ConfigError, load_config
    from recovery.recipe.serialize import config_from_json, config_to_json

    recipe = tmp_path / "r.yaml"
    recipe.write_text("checkpointless: {replication: {every_n_steps: auto, max_overhead: 0.05},"
                      " recovery: {mtbf_s: 10800}}")
    cfg = load_config(str(recipe), env={})
    assert cfg.replication.every_n_steps == "auto"
    assert cfg.replication.max_overhead == 0.05 and cfg.recovery.mtbf_s == 10800
    assert config_from_json(config_to_json(cfg)) == cfg  # what the worker reads back
    cfg = load_config(None, ["replication.every_n_steps=AUTO"], env={})
    assert cfg.replication.every_n_steps == "auto"
    cfg = load_config(None, [], env={"CHECKPOINTLESS_REPLICATION_EVERY_N_STEPS": "auto"})
    assert cfg.replication.every_n_steps == "auto"
    assert load_config(None, ["replication.every_n_steps=4"], env={}).replication \
        .every_n_steps == 4  # a fixed number still works as before
    assert load_config(env={}).recovery.mtbf_s is None
    assert load_config(env={}).replication.max_overhead == 0.02
    for bad in ("replication.every_n_steps=sometimes", "replication.every_n_steps=0",
                "replication.max_overhead=0", "recovery.mtbf_s=-5"):
        with pytest.raises(ConfigError) as err:
            load_config(None, [bad], env={})
        assert bad.split("=")[0] in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(None, ["replication.every_n_steps=sometimes"], env={})
    assert "'auto'" in str(err.value)


# -- the runtime's adapter (recovery/schedules/auto_interval.py), without a job -----------------
def test_auto_interval_agrees_applies_and_survives_a_rollback(monkeypatch) -> None:
    from recovery.recipe import CheckpointlessConfig
    from recovery.schedules import auto_interval
    from replication.training_state.state import TrainingState

    class Log:
        def __init__(self) -> None:
            self.events: list[dict] = []

        def emit(self, event: str, **fields: object) -> None:
            self.events.append({"event": event, **fields})

    settings = CheckpointlessConfig()
    assert settings.replication.every_n_steps == "auto"  # the default (ADR 0032)
    settings.replication.every_n_steps = 1
    assert auto_interval.AutoInterval.from_settings(
        settings, 0, Log(), TrainingState(), lambda t: None) is None  # a fixed number
    settings.replication.every_n_steps = "auto"
    others = [0]  # what the other rank proposes (0: nothing measured yet)

    def agree(t) -> None:  # all-reduce MAX with one other rank
        t[0] = max(int(t[0]), others[0])

    log, state = Log(), TrainingState()
    ai = auto_interval.AutoInterval.from_settings(settings, 0, log, state, agree)
    assert ai is not None and "_auto_interval" in state.replay_exempt
    assert settings.replication.every_n_steps == ai.policy.probe_every  # an int again
    ai.mtbf = lambda: (None, "")  # no MTBF: the budget's interval (agreeing is tested)
    clock = [0.0]
    # monkeypatch puts the real clock back (this test once "restored" the fake one:
    # every later test in the process then read a frozen perf_counter)
    monkeypatch.setattr(auto_interval.time, "perf_counter", lambda: clock[0])
    for step in range(1, auto_interval.AGREE_EVERY + 1):
        snap = step % settings.replication.every_n_steps == 0
        clock[0] += 0.1 + (0.01 if snap else 0.0)
        ai.after_step(step, snap, None)
    monkeypatch.undo()
    assert settings.replication.every_n_steps == 5  # 10 ms on 100 ms, 2 % budget
    assert log.events[-1]["event"] == "auto_interval" and log.events[-1]["every_n_steps"] == 5
    assert ai.state_dict()["every_n_steps"] == 5
    ai.load_state_dict({"every_n_steps": 8})  # a rollback to a step before the choice
    assert settings.replication.every_n_steps == 8
    others[0] = 12  # the other rank pays more: its interval is agreed by both
    ai.after_step(2 * auto_interval.AGREE_EVERY, True, None)
    assert settings.replication.every_n_steps == 12
    assert "another rank" in " ".join(log.events[-1]["reasons"])


def test_ranks_proposing_for_different_reasons_put_one_interval_in_force(monkeypatch) -> None:
    """Rank 0's interval is its budget's, rank 1's Daly's for frequent failures. The
    budget's shortens by halves at most, Daly's at once: which rule applies is agreed
    with the interval. Decided from each rank's own proposal, rank 0 once put 4 in force
    and rank 1 3, and the next round failed ("ranks disagree on the step being
    replicated")."""
    import threading

    from recovery.recipe import CheckpointlessConfig
    from recovery.schedules import auto_interval
    from replication.training_state.state import TrainingState

    class Log:
        def emit(self, event: str, **fields: object) -> None:
            pass

    barrier, box = threading.Barrier(2, timeout=30), {}

    def agree_for(rank: int):
        def agree(t: torch.Tensor) -> None:  # all-reduce MAX between the two threads
            box[rank] = t.clone()
            barrier.wait()
            t.copy_(torch.maximum(box[0], box[1]))
            barrier.wait()
        return agree

    settings = [CheckpointlessConfig(), CheckpointlessConfig()]
    ais = [auto_interval.AutoInterval.from_settings(settings[r], r, Log(), TrainingState(),
                                                    agree_for(r)) for r in (0, 1)]
    ais[0].mtbf = lambda: (None, "")  # the budget's interval: 5 ms on 100 ms, 3 steps
    ais[1].mtbf = lambda: (2.0, "")  # a failure every 2 s: Daly's, 1 step
    clock = [0.0]
    monkeypatch.setattr(auto_interval.time, "perf_counter", lambda: clock[0])
    for step in range(1, auto_interval.AGREE_EVERY):
        snap = step % 8 == 0  # the probe's interval, on both ranks
        clock[0] += 0.1 + (0.005 if snap else 0.0)
        for ai in ais:
            ai.after_step(step, snap, None)
    clock[0] += 0.1 + 0.005
    threads = [threading.Thread(target=ai.after_step, args=(auto_interval.AGREE_EVERY, True,
                                                            None)) for ai in ais]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert ais[0].policy.propose().budget_bound and not ais[1].policy.propose().budget_bound
    assert [s.replication.every_n_steps for s in settings] == [4, 4]  # 3, halved from 8


def test_auto_interval_assumes_an_mtbf_then_learns_the_observed_one(monkeypatch) -> None:
    """With ``recovery.mtbf_s`` unset, the interval is Daly's optimum for an assumed MTBF
    until failures are seen, then for their observed rate (ADR 0032); a replacement
    learns how long the job has run from the state it receives."""
    from recovery.recipe import CheckpointlessConfig
    from recovery.schedules import auto_interval
    from recovery.schedules.interval_policy import ASSUMED_MTBF_S
    from replication.training_state.state import TrainingState

    class Log:
        def __init__(self) -> None:
            self.events: list[dict] = []

        def emit(self, event: str, **fields: object) -> None:
            self.events.append({"event": event, **fields})

    settings, log, failures = CheckpointlessConfig(), Log(), [0]
    ai = auto_interval.AutoInterval.from_settings(settings, 0, log, TrainingState(),
                                                  lambda t: None, lambda: failures[0])
    assert ai is not None and ai.mtbf() == (ASSUMED_MTBF_S, ai.mtbf()[1])
    clock = [0.0]
    monkeypatch.setattr(auto_interval.time, "perf_counter", lambda: clock[0])

    def run(first: int, last: int) -> None:
        for step in range(first, last + 1):
            snap = step % settings.replication.every_n_steps == 0
            clock[0] += 0.1 + (0.01 if snap else 0.0)
            ai.after_step(step, snap, None)

    run(1, auto_interval.AGREE_EVERY)
    # 10 ms per snapshot on 100 ms steps: Daly for 3 h is 14.7 s of work
    assert settings.replication.every_n_steps == 147
    assert "assumed" in " ".join(log.events[-1]["reasons"])
    failures[0] = 3  # three failures in the 30 s the job has run: one every 10 s
    ai._t0 = auto_interval.time.monotonic() - 30.0
    mtbf, note = ai.mtbf()
    assert mtbf == pytest.approx(10.0, rel=0.05) and "observed: 3 failure(s)" in note
    run(auto_interval.AGREE_EVERY + 1, 2 * auto_interval.AGREE_EVERY)
    # Daly's for 10 s, 4 steps: the budget's 5 would lose more than 2 % to replays
    assert settings.replication.every_n_steps == 4
    assert "failures come so often" in " ".join(log.events[-1]["reasons"])
    monkeypatch.undo()
    # a replacement starts its clock from the job's time in the state it receives
    fresh = auto_interval.AutoInterval(CheckpointlessConfig(), 1, Log(), lambda t: None)
    fresh.load_state_dict(ai.state_dict())
    assert auto_interval.time.monotonic() - fresh._t0 >= 30.0
    settings.recovery.mtbf_s = 600.0  # given: used as is
    assert ai.mtbf() == (600.0, " (recovery.mtbf_s)")


def test_the_start_up_line_says_the_interval_and_what_a_failure_replays() -> None:
    from recovery.recipe import CheckpointlessConfig
    from recovery.schedules.auto_interval import startup_line

    c = CheckpointlessConfig()
    line = startup_line(c)
    assert "auto: every 8 steps" in line and "up to 7 steps, 3.5 on average" in line
    assert "assumed 3 h" in line and "2.0%" in line
    c.replication.every_n_steps = 1
    assert "; a failure replays no completed step" in startup_line(c)
    c.replication.every_n_steps = 10
    assert "up to 9 steps, 4.5 on average" in startup_line(c)


def test_a_replicator_with_more_copies_than_processes_follows_the_interval_in_force():
    """``every_n_steps: auto`` changes the interval in the job's settings object while
    training runs. A one-process job at the default k=2 keeps one copy; the replicator
    used to write that into a copy of the settings, so the interval chosen by auto never
    reached it (it snapshotted at the probe's interval for the whole run)."""
    import torch
    import torch.distributed as dist

    from replication.config import ReplicationConfig
    from replication.replica_protocol.replicator import Replicator
    from replication.training_state.state import TrainingState

    settings = ReplicationConfig(factor=2, timeout_s=10, every_n_steps=8)
    state = TrainingState()
    state.register("model", torch.nn.Linear(4, 4))
    rep = Replicator(state, store=dist.HashStore(), rank=0, world_size=1, node=0,
                     config=settings)
    try:
        assert rep.factor == 1 and rep.config is settings
        settings.every_n_steps = 5  # what AutoInterval does when the agreement lands
        assert rep.maybe_snapshot(5) is not None and rep.maybe_snapshot(8) is None
    finally:
        rep.close()


def test_frequent_failures_override_the_budget() -> None:
    """When the budget's interval would lose more to replays than the budget itself,
    Daly's optimum is taken even though its snapshots cost more (ADR 0032): in a chaos
    soak (a failure every 2 s) the budget's 470 steps would never commit."""
    from recovery.schedules.interval_policy import choose_interval

    ch = choose_interval(step_s=0.031, snapshot_cost_s=0.291, mtbf_s=2.0)
    assert ch.every_n_steps == ch.n_daly < ch.n_budget
    assert "failures come so often" in ch.text
    # rare failures: the budget stays a ceiling
    rare = choose_interval(step_s=0.031, snapshot_cost_s=0.291, mtbf_s=10**6)
    assert rare.every_n_steps >= rare.n_budget


def test_an_interrupted_interval_is_no_sample() -> None:
    """Steps around a recovery run slow; they must not read as a snapshot's cost."""
    from recovery.schedules.interval_policy import IntervalPolicy

    p = IntervalPolicy(probe_every=4, settle_steps=1)
    for i in range(1, 9):  # two clean intervals: 10 ms per snapshot on 100 ms steps
        p.observe(0.11 if i % 4 == 0 else 0.1, i % 4 == 0)
    assert p.snapshot_cost_s == pytest.approx(0.01)
    p.observe(0.1, False)
    p.interrupted()  # a rollback; the next steps are slow
    for _ in range(3):
        p.observe(2.0, False)
    p.observe(2.0, True)  # the first snapshot after it: no sample, plain unchanged
    assert p.snapshot_cost_s == pytest.approx(0.01) and p.plain_step_s == pytest.approx(0.1)
    for i in range(1, 5):  # sampled again from there on
        p.observe(0.13 if i == 4 else 0.1, i == 4)
    assert list(p._costs) == pytest.approx([0.01, 0.03])
