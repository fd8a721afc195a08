"""A SIGTERM with ``--on-sigterm drain`` (the default in a Slurm step) stops the job
once every rank persisted the newest committed step; a new run resumes from it and ends
bit-identical to an uninterrupted one.

Real agents and workers (2 nodes x 2 ranks). The signal reaches node 1's agent only:
node 0 learns the stop from the job's record, as a node whose own signal comes late
would. tests/test_slurm.py does the same through ``scancel`` and Slurm's requeue.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from replication import contract
from replication.durable import latest_checkpoint, verify
from tests.lab_jobs import wait_events
from tests.recovery_harness import TRAIN_ARGS, assert_same_final, assert_succeeded, run_job

pytestmark = pytest.mark.timeout(300)

SLOW = (*TRAIN_ARGS, "--step-sleep", "0.3")  # time to signal mid-run; the same state


def _persisting(ckpt: Path) -> tuple[str, ...]:
    # every_n_steps far away: the only saves are the stop's and the final step's
    return (f"persistence.path={ckpt}", "persistence.every_n_steps=1000",
            "--on-sigterm=drain")


def _sigterm_node_1_at_step_10(run_dir: Path) -> None:
    events = wait_events(run_dir, lambda ev: any(
        e.get("event") == "step" and e["step"] >= 10 for e in ev), "training to reach step 10")
    pid = next(e["pid"] for e in events if e.get("event") == "agent_start" and e["node"] == 1)
    os.kill(pid, signal.SIGTERM)


def test_a_drain_persists_the_committed_step_and_a_new_run_resumes_it(tmp_path):
    reference = run_job(tmp_path / "reference", nnodes=2)
    assert_succeeded(reference)
    ckpt = tmp_path / "ckpt"
    stopped = run_job(tmp_path / "stopped", nnodes=2, overrides=_persisting(ckpt),
                      script_args=SLOW, during=_sigterm_node_1_at_step_10, timeout_s=150)
    assert not stopped.timed_out, stopped.output()
    assert stopped.returncodes == {0: contract.EXIT_RETRY, 1: contract.EXIT_RETRY}, (
        stopped.returncodes, stopped.output())
    drained = stopped.events("drained")
    assert sorted(e["rank"] for e in drained) == [0, 1, 2, 3], stopped.output()
    steps = {e["step"] for e in drained}
    assert len(steps) == 1 and {e["persisted"] for e in drained} == steps, drained
    step = steps.pop()
    assert 8 <= step < 16, step  # a committed snapshot, before the end
    assert not stopped.events("recovery") and not stopped.finals()
    assert "stopped for the scheduler at committed step" in stopped.output(20000)
    newest = latest_checkpoint(str(ckpt))
    assert newest is not None and newest.step == step and verify(newest).ok

    resumed = run_job(tmp_path / "resumed", nnodes=2,
                      overrides=(f"persistence.path={ckpt}", "persistence.every_n_steps=1000"))
    assert_succeeded(resumed)
    assert [e["step"] for e in resumed.events("durable_resume")][:1] == [step]
    assert_same_final(reference, resumed)


def test_without_persistence_a_drain_still_stops_with_75(tmp_path):
    job = run_job(tmp_path / "run", nnodes=2, overrides=("--on-sigterm=drain",),
                  script_args=SLOW, during=_sigterm_node_1_at_step_10, timeout_s=150)
    assert job.returncodes == {0: contract.EXIT_RETRY, 1: contract.EXIT_RETRY}, job.output()
    assert {e["persisted"] for e in job.events("drained")} == {None}
    assert "nothing persisted (no persistence.path)" in job.output(20000)
