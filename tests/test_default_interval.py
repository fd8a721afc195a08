"""The default snapshot interval (``replication.every_n_steps: auto``, ADR 0032), as a job
with no settings at all gets it: the start-up line, the choice after the probe, and
failures during the probe and after the choice, recovered like any other.

Real processes under ``checkpointless run`` (``examples/train_gpt.py``, 2 workers), no
``replication.*`` key set anywhere; each run's end is compared with a failure-free run
of the same arguments (model, optimizer, steps and data order, bit-identical).
"""

from __future__ import annotations

import pytest

from recovery.schedules.auto_interval import AGREE_EVERY
from tests.recovery_harness import (
    assert_recovered,
    assert_same_final,
    assert_succeeded,
    run_job,
)

pytestmark = pytest.mark.timeout(240)

STEPS = AGREE_EVERY + 16  # past the probe's agreement
ARGS = ("--steps", str(STEPS), "--dim", "32", "--layers", "1", "--batch", "4",
        "--seq-len", "16")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = run_job(tmp_path_factory.mktemp("reference"), script_args=ARGS)
    assert_succeeded(job)
    assert not job.events("recovery")
    return job


def _snapshots(job) -> list[int]:
    """Steps rank 0 snapshotted (its ``step`` events with a stall), in order."""
    return [int(e["step"]) for e in job.events("step") if e.get("stall_s") is not None]


def test_no_settings_probe_then_choose_and_say_so(reference):
    out = reference.output(tail=10**7)
    assert "snapshot interval: auto: every 8 steps while the first 64 measure" in out, out
    assert "a failure replays up to 7 steps, 3.5 on average" in out, out
    chosen = [e for e in reference.events("auto_interval") if e.get("rank") == 0
              and e.get("tier") == "replication"]
    assert chosen and chosen[0]["step"] == AGREE_EVERY, chosen
    n = int(chosen[0]["every_n_steps"])
    line = f"snapshot interval at step {AGREE_EVERY}: every {n} steps"
    assert line in out and "a failure replays" in out, out
    # the probe snapshots every 8 steps; the chosen interval applies after step 64
    snaps = _snapshots(reference)
    assert [s for s in snaps if s <= AGREE_EVERY] == list(range(8, AGREE_EVERY + 1, 8))
    assert all(s % n == 0 for s in snaps if AGREE_EVERY < s < STEPS), (n, snaps)
    assert STEPS in snaps  # run() snapshots its last step


@pytest.mark.parametrize("fault_step", [13, AGREE_EVERY + 6])
def test_a_failure_in_the_probe_or_after_the_choice_recovers(tmp_path, reference,
                                                              fault_step):
    """Rank 1 SIGKILLed in a step's backward, a fresh process replaces it: the job rolls
    back to the newest committed snapshot (step 8 in the probe; step 64, the last the
    probe took, after it: the interval chosen for fast steps is far longer than the
    run) and ends bit-identical."""
    job = run_job(tmp_path / "run", script_args=ARGS,
                  # the snapshot path: live rollback (ADR 0039) would replay nothing
                  overrides=[f"recovery.fault=1:{fault_step}:backward",
                             "recovery.live_rollback=false"])
    assert_succeeded(job)
    assert_same_final(reference, job)
    recs = assert_recovered(job)
    snaps = sorted({s for s in _snapshots(job) if s < fault_step})
    # the newest snapshot before the fault, or the one before it when the newest's
    # round had not committed yet (the kill raced it)
    assert {int(e["target_step"]) for e in recs} <= {0, *snaps[-2:]}, (recs, snaps)
    assert {int(e["target_step"]) for e in recs} & set(snaps[-2:]), (recs, snaps)
