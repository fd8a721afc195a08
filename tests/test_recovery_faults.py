"""Fault injection on one node, with real processes under the real ``checkpointless run``.

Each test runs ``examples/train_gpt.py`` on 2 workers (``--standalone``) with one fault
from ``recovery.fault`` and checks that the job exits 0 with final model+optimizer
digests, steps and data-order hashes bit-identical to a failure-free run of the same
training arguments, and that ``events.jsonl`` shows the fault, the recovery and no
committed step lost. The last tests check that unrecoverable failures stop the job with
a clear message instead of hanging.
"""

from __future__ import annotations

import pytest

from tests.recovery_harness import (
    TRAIN_ARGS,
    assert_failed_cleanly,
    assert_recovered,
    assert_same_final,
    assert_succeeded,
    run_job,
    stop_reason,
)

pytestmark = pytest.mark.timeout(240)

FAULT_STEP = 8

#: Fast hang detection (the agent kills a worker silent this long).
HANG_DETECTION = ("recovery.heartbeat_timeout_s=6", "recovery.heartbeat_interval_s=0.5")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The failure-free run every test compares with (same training arguments)."""
    job = run_job(tmp_path_factory.mktemp("reference"))
    assert_succeeded(job)
    assert not job.events("recovery"), "the reference run recovered from something"
    finals = job.finals()
    assert sorted(finals) == [0, 1]
    assert all(f["step"] == 16 for f in finals.values())
    return job


def _assert_replaced(job, rank: int, *, how: str) -> None:
    exits = [e for e in job.events("worker_exit") if e["rank"] == rank]
    assert exits and exits[0]["signal"] == "SIGKILL", f"rank {rank} exits: {exits}"
    assigned = [e for e in job.events("replacement_assigned") if e["rank"] == rank]
    assert len(assigned) == 1, f"expected one replacement of rank {rank}, got {assigned}"
    assert assigned[0]["started"] == how, (
        f"rank {rank} replaced by {assigned[0]['started']!r}, expected {how!r}")
    newcomers = [e for e in job.events("recovery") if e["newcomer"]]
    assert [e["rank"] for e in newcomers] == [rank]
    assert newcomers[0]["bytes_transferred"] > 0, "the replacement received no state"
    assert newcomers[0]["providers"] == {str(rank): 1 - rank}


@pytest.mark.parametrize(
    ("rank", "phase", "spares", "zygote"),
    [
        pytest.param(1, "forward", 1, True, id="forward-warm-spare"),
        pytest.param(0, "backward", 0, False, id="backward-fresh-process"),
        pytest.param(1, "optimizer", 1, True, id="optimizer-warm-spare"),
        pytest.param(1, "snapshot", 0, True, id="snapshot-forked-process"),
    ],
)
def test_sigkill_one_worker(tmp_path, reference, rank, phase, spares, zygote):
    fault = f"{rank}:{FAULT_STEP}:{phase}"
    job = run_job(tmp_path / "run", spares=spares, zygote=zygote,
                  overrides=[f"recovery.fault={fault}"])
    assert_succeeded(job)
    assert_same_final(reference, job)
    recs = assert_recovered(job)
    fired = job.events("fault_injected")[0]
    assert (fired["rank"], fired["step"], fired["phase"], fired["kind"]) == (
        rank, FAULT_STEP, phase, "sigkill")
    assert {e["gen"] for e in recs} == {1}, "one failure must make exactly one generation"
    _assert_replaced(job, rank, how="spare" if spares else "fork" if zygote else "exec")
    assert job.events("job_done")[0]["recoveries"] == 1


@pytest.mark.parametrize("phase", ["snapshot", "replication"])
def test_a_kill_while_the_last_step_commits_is_recovered(tmp_path, reference, phase):
    """Rank 1 dies in the final step's snapshot round (step 16 of 16). Its survivor
    waits for that round after the loop: the failure must roll back like any other
    (it escaped ``cl.run``, the survivor exited 1, and the job lost every copy of the
    committed state: the chaos soak's "final state written by ranks [] only")."""
    job = run_job(tmp_path / "run", spares=1, overrides=[f"recovery.fault=1:16:{phase}"])
    assert_succeeded(job)
    assert_same_final(reference, job)
    assert_recovered(job)
    assert [(e["step"], e["phase"]) for e in job.events("fault_injected")] == [(16, phase)]
    assert not [e for e in job.events("worker_exit") if e["exitcode"] == 1]


@pytest.mark.parametrize("phase", ["forward", "snapshot"])
def test_sigkill_with_every_optimizer_tensor_copied_overlapped(tmp_path, reference, phase):
    """``replication.overlap_min_bytes=0``: every weight and optimizer tensor of this small
    model is copied by the round while the next step runs (ADR 0013), so failures,
    rollbacks and a replacement go through the overlapped copy and its fences. The
    result must equal the reference run, whose snapshots copy them in the loop."""
    job = run_job(tmp_path / "run", spares=1, overrides=[
        f"recovery.fault=1:{FAULT_STEP}:{phase}", "replication.overlap_min_bytes=0"])
    assert_succeeded(job)
    assert_same_final(reference, job)
    assert_recovered(job)
    _assert_replaced(job, 1, how="spare")
    # A live rollback's step is captured and sealed inside the recovery, where nothing
    # runs to overlap its copy with: its round copies nothing.
    live = {int(e["target_step"]) for e in job.events("recovery") if e.get("live")}
    rounds = [e["replicated"] for e in job.events("step") if e.get("replicated")]
    assert rounds and all(r["overlapped_bytes"] > 0 for r in rounds
                          if r["step"] not in live), rounds[:3]
    assert not [e for e in reference.events("step")
                if (e.get("replicated") or {}).get("overlapped_bytes")], \
        "the reference run's model is under the default overlap_min_bytes"


def test_snapshot_torn_by_an_in_place_change_is_never_committed(tmp_path, reference):
    """Rank 1 changes a weight in place (``mul_(1.0)``) right after the snapshot of step
    FAULT_STEP, while its round, delayed a second, has not copied it yet. The next
    optimizer step's fence copies the weight and finds its version changed: the round
    fails with the torn snapshot instead of acknowledging it. No process dies: the job
    recovers in-process to the step before, rank 1 goes on with overlapped copies off,
    and the end is bit-identical (the change changed no value)."""
    job = run_job(tmp_path / "run", script="tests/launcher_scripts/torn_snapshot_gpt.py",
                  script_args=("--tear", f"1:{FAULT_STEP}", *TRAIN_ARGS),
                  overrides=["replication.overlap_min_bytes=0"])
    assert_succeeded(job)
    assert_same_final(reference, job)
    output = job.output(tail=10**7)
    assert "changed (" in output and f"snapshot of step {FAULT_STEP}" in output, output
    recs = job.events("recovery")
    assert {e["gen"] for e in recs} == {1} and len(recs) == 2, recs
    cause = recs[0]["cause"]
    assert (cause["kind"], cause["rank"]) == ("exception", 1), cause
    assert f"snapshot of step {FAULT_STEP} is torn" in cause["error"], cause
    # The torn step was never committed: both ranks rolled back to the snapshot before
    # (the step before with every step snapshotted; under the default interval, auto,
    # whichever the probe took last).
    before = max([0, *(int(e["step"]) for e in job.events("step")
                       if e.get("stall_s") is not None and int(e["step"]) < FAULT_STEP)])
    assert {e["target_step"] for e in recs} == {before}, recs
    assert not [e for e in job.events("worker_exit") if e.get("signal")], \
        job.events("worker_exit")
    assert "overlapped snapshot copies are off for the rest of this run" in output, output


def test_sigkill_during_replication(tmp_path, reference):
    """Killed after sending its replica, before acknowledging the step.

    The survivor's round then waits for an acknowledgement that never comes. It must
    keep heartbeating and start recovering at once, not when its commit wait times out
    (60 s here instead of the default 120 s, so a regression fails sooner). Regression
    test: the commit wait used to block the shared store client (the survivor was
    killed as hung, fixed in 245350c), then to hold the training thread in
    ``Replicator.wait`` until the timeout (fixed in 3c4c55e).
    """
    job = run_job(tmp_path / "run", spares=1, timeout_s=150, overrides=[
        f"recovery.fault=1:{FAULT_STEP}:replication", "replication.timeout_s=60",
        *HANG_DETECTION])
    assert_succeeded(job)
    assert_same_final(reference, job)
    recs = assert_recovered(job)
    assert not job.events("worker_hung"), "the survivor must keep heartbeating"
    fired = job.events("fault_injected")[0]["ts"]
    late = {e["rank"]: round(e["ts"] - fired, 1) for e in recs if e["ts"] - fired > 25}
    assert not late, f"seconds from the fault to each rank's recovery: {late}"
    _assert_replaced(job, 1, how="spare")


def test_exception_on_one_rank(tmp_path, reference):
    """An exception on rank 1 only: recovered in-process, no process replaced."""
    job = run_job(tmp_path / "run",
                  overrides=[f"recovery.fault=1:{FAULT_STEP}:forward:exception"])
    assert_succeeded(job)
    assert_same_final(reference, job)
    recs = assert_recovered(job)
    assert not job.events("replacement_assigned"), "an exception must not cost a process"
    assert not [e for e in job.events("worker_exit") if e["exitcode"] != 0]
    local = {e["rank"]: e["local_cause"] for e in recs}
    assert local[1]["kind"] == "exception" and "InjectedFault" in local[1]["error"]
    assert all(not e["newcomer"] and e["bytes_transferred"] == 0 for e in recs), (
        "both ranks hold their own snapshot: nothing should be transferred"
    )


def test_hung_worker_is_killed_and_replaced(tmp_path, reference):
    """A SIGSTOPped rank stops heartbeating; its agent kills it and a spare takes over."""
    job = run_job(tmp_path / "run", spares=1, overrides=[
        f"recovery.fault=1:{FAULT_STEP}:backward:sigstop", *HANG_DETECTION])
    assert_succeeded(job)
    assert_same_final(reference, job)
    assert_recovered(job)
    hung = job.events("worker_hung")
    assert [e["rank"] for e in hung] == [1], f"expected rank 1 (only) killed as hung: {hung}"
    assert hung[0]["silent_s"] >= 6
    declared = job.events("failure_declared")
    assert declared and declared[0]["cause"]["kind"] == "worker_hung"
    _assert_replaced(job, 1, how="spare")


def test_rollback_is_bounded_by_snapshot_interval(tmp_path, reference):
    """With snapshots every 3 steps and no live rollback (ADR 0039: with it the job
    goes on from step 7, tests/test_live_rollback.py), a fault at step 8 rolls back to
    the newest committed snapshot step: 6 if its round had committed when the fault
    hit, else 3 (the round runs in the background, so which one is a matter of timing),
    never further back than what was committed."""
    job = run_job(tmp_path / "run", spares=1, overrides=[
        f"recovery.fault=1:{FAULT_STEP}:backward", "replication.every_n_steps=3",
        "recovery.live_rollback=false"])
    assert_succeeded(job)
    assert_same_final(reference, job)
    recs = assert_recovered(job, every_n_steps=3)
    (fault,) = job.events("fault_injected")
    targets = {e["target_step"] for e in recs}
    assert len(targets) == 1, targets
    (target,) = targets
    assert target % 3 == 0, f"rolled back to {target}, which was never snapshotted"
    assert fault["committed"] <= target <= FAULT_STEP - FAULT_STEP % 3, (fault, target)


POST_RUN_SCRIPT = """\
import sys, time
import torch
from recovery import Checkpointless

torch.manual_seed(0)
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
cl = Checkpointless(model=model, optimizer=opt)

def train_step(step):
    model(torch.ones(2, 4)).sum().backward()
    cl.all_reduce_gradients(model)
    opt.step()
    opt.zero_grad()

cl.run(train_step, 3)
time.sleep(float(sys.argv[1]))  # what scripts do after training: evaluate, save, upload
"""


def test_work_after_training_is_not_a_hang(tmp_path):
    """A rank that finished training and then saves for 5 s is not hung (timeout 2 s).

    Regression test: ``_finish`` used to stop the heartbeats, so the agent killed
    finished ranks as hung and declared a failure after training had ended.
    """
    script = tmp_path / "post_run.py"
    script.write_text(POST_RUN_SCRIPT)
    # 2 s, not less: on a loaded 2-core box a worker can stall that long mid-training.
    job = run_job(tmp_path / "run", script=str(script), script_args=("5",), overrides=[
        "recovery.heartbeat_timeout_s=2", "recovery.heartbeat_interval_s=0.2"], timeout_s=90)
    assert_succeeded(job)
    assert not job.events("failure_declared") and not job.events("recovery")
    done = max(e["ts"] for e in job.events("worker_done"))
    # Interpreter teardown after the heartbeats stop (atexit) may still be cut short;
    # the 5 s of the script's own work after training must not be.
    early = [e for e in job.events("worker_hung") if e["ts"] < done + 5.0]
    assert not early, f"killed as hung while working after training: {early}"
    assert job.events("job_done")[0]["committed_step"] == 3


# --- unrecoverable: the job must stop, with a reason, not hang ---------------------------
def test_every_copy_lost_stops_the_job(tmp_path):
    """replication.factor=1: a killed rank's state has no other copy."""
    job = run_job(tmp_path / "run", overrides=[
        "replication.factor=1", f"recovery.fault=1:{FAULT_STEP}:snapshot"], timeout_s=120)
    assert_failed_cleanly(job)
    reason = stop_reason(job)
    assert "rank 1" in reason and "no surviving copy" in reason, reason or job.output()
    assert "rank 0" not in reason, f"rank 0's state was not lost: {reason}"
    assert job.events("fatal"), "the workers should record why recovery is impossible"
    assert not job.finals(), "no rank may finish training after its peer's state is gone"


def test_max_restarts_zero_stops_the_job(tmp_path):
    job = run_job(tmp_path / "run", overrides=[
        "recovery.max_restarts=0", f"recovery.fault=1:{FAULT_STEP}:snapshot"], timeout_s=120)
    assert_failed_cleanly(job)
    reason = stop_reason(job)
    assert "max_restarts=0" in reason and "exceeded" in reason, reason or job.output()
    assert not job.events("recovery"), "no recovery may complete with max_restarts=0"
    assert not job.events("replacement_assigned")


def test_memory_budget_refusal_stops_the_job_at_start(tmp_path):
    """A budget too small for the state refuses to start, once, with the numbers: a
    replacement would need the same memory, so the job must not fail over and over
    (it used to replace the refusing workers until the timeout)."""
    job = run_job(tmp_path / "run", spares=1, overrides=["memory.host_budget_bytes=100000"],
                  timeout_s=120)
    assert_failed_cleanly(job)
    reason = stop_reason(job)
    assert "cannot hold this rank's recovery state" in reason, reason or job.output()
    assert "memory.host_budget_bytes=100000" in reason and "needs" in reason, reason
    assert not job.events("recovery") and not job.events("replacement_assigned"), \
        job.events("replacement_assigned")
    assert not job.finals()
