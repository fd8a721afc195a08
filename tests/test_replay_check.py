"""A survivor's replay is checked against its first run, and data-parallel ranks against
each other.

Adapting nanoGPT, whose loop fetches the next batch at the end of each step, a user who
registers the loader but not the prefetched batch gets a recovery that reports success
while 46 of 61 tensors end different. The runtime now compares the snapshot digests of
each step a survivor replays with those it took before the failure, and says which
state differs. Real launcher, a SIGKILL, the script in ``tests/user_scripts``.
"""

from __future__ import annotations

import pytest

from replication.snapshots.replay_check import ReplayCheck
from tests.recovery_harness import REPO, assert_succeeded, run_job

pytestmark = pytest.mark.timeout(240)

SCRIPT = str(REPO / "tests" / "user_scripts" / "nanogpt_habits.py")
# Every step snapshotted: these tests name the step a fault, a drift or a replay is at
# (the default interval, auto, probes at every 8 steps; its replays are tested elsewhere).
FAST = ("recovery.heartbeat_timeout_s=3", "recovery.heartbeat_interval_s=0.5",
        "replication.every_n_steps=1")


def test_only_steps_after_the_rollback_are_compared():
    check = ReplayCheck()
    for step in range(1, 6):
        check.record(step, {"model": f"m{step}", "rng": f"r{step}"})
    check.rolled_back(3)
    check.record(3, {"model": "other", "rng": "other"})  # the target, re-captured: no replay
    check.record(4, {"model": "m4", "rng": "r4"})  # replayed exactly
    check.record(5, {"model": "changed", "rng": "r5"})
    check.record(6, {"model": "new", "rng": "r6"})  # never ran before
    assert check.take_differences() == [(5, ["model"])]
    assert check.take_differences() == []
    check.record(5, {"model": "again", "rng": "r5"})  # compared once, not twice
    assert check.take_differences() == []


def test_exempt_entries_are_not_compared():
    check = ReplayCheck()
    check.record(5, {"model": "m", "trainer": "t0"})
    check.rolled_back(4)
    check.record(5, {"model": "m", "trainer": "t1"}, exempt=frozenset({"trainer"}))
    assert check.take_differences() == []


def test_old_steps_are_forgotten():
    check = ReplayCheck(keep=4)
    for step in range(1, 11):
        check.record(step, {"model": str(step)})
    check.rolled_back(0)
    check.record(2, {"model": "x"})  # forgotten: nothing to compare with
    check.record(9, {"model": "x"})
    assert check.take_differences() == [(9, ["model"])]


def _run(tmp_path, name: str, *args: str, fault: str = ""):
    # The replay check compares replayed steps, and a live rollback (ADR 0039) replays
    # none: these jobs turn it off to have replays to check.
    overrides = [*FAST, *([f"recovery.fault={fault}"] if fault else []),
                 "recovery.live_rollback=false"]
    return run_job(tmp_path / name, nproc=2, spares=1, timeout_s=150, script=SCRIPT,
                   script_args=("--steps", "16", *args), overrides=overrides)


def test_a_prefetched_batch_left_unregistered_is_reported(tmp_path):
    # Rank 1 dies after step 8's replicas moved but before it acknowledged them, so step
    # 8 is never committed and rank 0, which already ran it, must replay it. A kill in
    # step 8's backward left it to timing: when step 7's commit had landed first (CI),
    # the rollback went to 7, step 8 had never run before, and nothing was compared.
    job = _run(tmp_path, "hidden", fault="1:8:replication:sigkill")
    assert_succeeded(job)
    diverged = job.events("replay_diverged")
    assert diverged, f"no replay was reported different\n{job.output()}"
    assert {e["rank"] for e in diverged} == {0}, diverged  # the survivor; rank 1 is new
    assert all("model" in e["segments"] for e in diverged), diverged
    warnings = [line for line in job.output().splitlines()
                if "checkpointless: WARNING: rank 0 replayed step" in line]
    assert len(warnings) == 1, job.output()
    assert "register it: a batch fetched ahead of its step" in warnings[0]


def test_the_registered_batch_replays_exactly(tmp_path):
    reference = _run(tmp_path, "reference", "--register-batch")
    job = _run(tmp_path, "registered", "--register-batch", fault="1:8:backward:sigkill")
    assert_succeeded(reference)
    assert_succeeded(job)
    assert job.events("recovery"), "nothing was recovered"
    assert not job.events("replay_diverged"), job.events("replay_diverged")
    ref, got = reference.finals(), job.finals()
    assert {r: f["digest"] for r, f in got.items()} == {r: f["digest"] for r, f in ref.items()}


def test_ranks_seeded_differently_are_told_at_the_first_step(tmp_path):
    """nanoGPT's per-rank seed without DDP's broadcast: every rank trains its own model.
    Averaging gradients never makes different weights equal; rank 0 says so once."""
    job = _run(tmp_path, "seeds", "--seed-by-rank", "--register-batch")
    assert_succeeded(job)
    events = job.events("replicas_differ")
    assert {e["rank"] for e in events} == {0, 1} and {e["step"] for e in events} == {1}
    assert events[0]["groups"] == "[0] vs [1]", events
    warnings = [line for line in job.output().splitlines()
                if "the ranks train different models" in line]
    assert len(warnings) == 1, job.output()
    # the same seed everywhere: not a word
    same = _run(tmp_path, "same", "--register-batch")
    assert_succeeded(same)
    assert not same.events("replicas_differ")


def test_replicas_that_drift_apart_are_reported(tmp_path):
    """Rank 1 alone changes a weight at step 5: the model entry, identical on both ranks
    at the first round, differs from step 5's round on. Rank 0 says so once."""
    job = _run(tmp_path, "drift", "--register-batch", "--drift-at", "5")
    assert_succeeded(job)
    drifted = job.events("replicas_drifted")
    assert drifted and {e["entry"] for e in drifted} == {"model"}, drifted
    assert {e["step"] for e in drifted} == {5}, drifted
    assert drifted[0]["split"] == "identical on [0, 1], now [0] vs [1]", drifted
    lines = [line for line in job.output().splitlines() if "drifted apart" in line]
    assert len(lines) == 1 and "state entry 'model'" in lines[0], job.output()


def test_drift_is_judged_within_the_groups_that_matched():
    from replication.replica_protocol.drift import DriftWatch

    watch = DriftWatch()
    watch.watch({"model"})
    # HSDP-like: ranks {0, 1} and {2, 3} each hold one replica; "loader" is not watched
    watch.observe(1, ["model", "loader"], [[1, 7], [1, 7], [2, 7], [2, 7]])
    watch.observe(2, ["model", "loader"], [[3, 1], [3, 2], [4, 3], [4, 4]])
    assert watch.take() == []
    watch.observe(3, ["model", "loader"], [[5, 1], [5, 2], [6, 3], [9, 4]])
    assert watch.take() == [(3, "model", "identical on [2, 3], now [2] vs [3]")]
    watch.observe(4, ["model", "loader"], [[1, 1], [2, 2], [3, 3], [4, 4]])
    assert watch.take() == []  # reported once per entry


def test_a_replayed_step_is_printed_once(tmp_path):
    """A reported problem: "the replayed step prints twice". Rank 1 dies in step 10's
    replication round (after rank 0 printed step 10's loss, before step 10 was
    committed), so rank 0 rolls back to 9 and replays 10; ``cl.replaying(10)`` lets the
    script print it once. (With live rollback, ADR 0039, nothing is replayed here: the
    job goes on from step 10, so the test turns it off to have a replay.)"""
    job = run_job(tmp_path / "run", nproc=2, timeout_s=90,
                  script_args=("--steps", "16", "--dim", "32", "--layers", "1", "--batch",
                               "4", "--seq-len", "16"),
                  overrides=["recovery.fault=1:10:replication:sigkill",
                             "replication.every_n_steps=1", "recovery.live_rollback=false"])
    assert_succeeded(job)
    [rec] = [e for e in job.events("recovery") if e["rank"] == 0]
    assert rec["target_step"] == 9, rec
    printed = [line for line in job.agents[0].stdout.splitlines() if "] step " in line]
    assert [line.split()[-3] for line in printed] == ["10", "16"], printed
