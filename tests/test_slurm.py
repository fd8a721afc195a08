"""``checkpointless run`` under a real Slurm cluster (tests/slurm_cluster.py), through the
shipped batch script, ``examples/slurm/train.sbatch``.

Three compute nodes, each slurmd in its own network and UTS namespace: a job of two
training nodes with two workers each, plus one spare node. A worker SIGKILLed mid-step
recovers in-process, bit-identical to a failure-free run under the same Slurm; so does
a whole node killed (slurmd and everything else in its namespace), on the spare node,
while Slurm keeps the job running; a script's own error ends the job with the
do-not-requeue status, and Slurm does not requeue it.

Skipped without ``slurm-wlm`` and ``munge`` or without root, unless
``TESTS_REQUIRE_SLURM=1`` (CI), which fails instead.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from replication import contract
from tests import slurm_cluster
from tests.lab_jobs import FAST_DETECTION, wait_events
from tests.recovery_harness import (
    REPO,
    SCRIPT,
    TRAIN_ARGS,
    JobResult,
    assert_same_final,
)

pytestmark = pytest.mark.timeout(400)

_missing = slurm_cluster.available()
if _missing is not None:
    if os.environ.get("TESTS_REQUIRE_SLURM") == "1":
        pytest.fail(f"{_missing}, and TESTS_REQUIRE_SLURM=1", pytrace=False)
    pytest.skip(_missing, allow_module_level=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[slurm_cluster.SlurmCluster]:
    c = slurm_cluster.SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=3).start()
    try:
        yield c
    finally:
        c.close()


def _submit(cluster: slurm_cluster.SlurmCluster, run_dir: Path, *overrides: str,
            script: str = SCRIPT, script_args: tuple[str, ...] = TRAIN_ARGS,
            timeout_s: float = 180, during: Callable[[str], None] | None = None,
            ) -> tuple[slurm_cluster.JobInfo, JobResult, str]:
    return cluster.run_template(run_dir, *overrides, script=script,
                                script_args=script_args, timeout_s=timeout_s, during=during)


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    info, job, out = _submit(cluster, tmp_path_factory.mktemp("ref") / "run")
    assert (info.state, info.status) == ("COMPLETED", 0), (info.fields, out[-4000:])
    assert sorted(job.finals()) == [0, 1, 2, 3], out[-4000:]
    assert not job.events("recovery"), "the failure-free run recovered from something"
    return job, out


def test_the_agents_take_their_places_from_srun(reference):
    job, out = reference
    starts = {e["node"]: e for e in job.events("agent_start")}
    assert sorted(starts) == [0, 1, 2], starts
    assert out.count("checkpointless: Slurm job ") == 1, out[-3000:]  # node 0 says it
    assert "3 node(s), 2 training and 1 spare" in out, out[-3000:]
    workers = {(e["node"], e["rank"]) for e in job.events("worker_start")}
    assert workers == {(0, 0), (0, 1), (1, 2), (1, 3)}, workers  # none on the spare


def test_a_killed_worker_recovers_in_process_bit_identical(cluster, reference, tmp_path):
    info, job, out = _submit(cluster, tmp_path / "run", "recovery.fault=2:6:backward")
    assert (info.state, info.status, info.restarts) == ("COMPLETED", 0, 0), (
        info.fields, out[-4000:])
    fired = [(e["rank"], e["phase"]) for e in job.events("fault_injected")]
    assert fired == [(2, "backward")], fired
    assert [e["rank"] for e in job.events("replacement_assigned")] == [2]
    assert_same_final(reference[0], job)
    assert "failures recovered: 1" in out, out[-3000:]


def test_a_script_error_is_not_requeued(cluster, tmp_path):
    bug = REPO / "tests" / "user_scripts" / "bug_at_step.py"
    info, _, out = _submit(cluster, tmp_path / "run", script=str(bug), script_args=())
    assert info.state == "FAILED" and info.status == contract.EXIT_SCRIPT_ERROR, (
        info.fields, out[-4000:])
    assert info.restarts == 0, info.fields
    assert "not requeued: the script failed (exit 93)" in out, out[-3000:]
    assert "the script's own error, a retry fails the same way" in out, out[-3000:]


def test_a_killed_node_moves_to_the_spare_node_and_slurm_keeps_the_job(
        cluster, reference, tmp_path):
    run_dir = tmp_path / "run"
    seen: dict[str, object] = {}

    def kill_node_1(job_id: str) -> None:
        wait_events(run_dir, lambda ev: any(e.get("event") == "step" and e["step"] >= 3
                                             for e in ev), "training to reach step 3", 120)
        seen["killed"] = cluster.kill_node(1)
        wait_events(run_dir, lambda ev: any(e.get("event") == "node_takeover" for e in ev),
                    "the spare node to take node 1's ranks over", 60)
        seen["during"] = cluster.job(job_id).state

    info, job, out = _submit(
        cluster, run_dir, *FAST_DETECTION, script_args=(*TRAIN_ARGS, "--step-sleep", "0.4"),
        during=kill_node_1)
    try:
        assert seen["killed"], "nothing ran in node 1's namespace"
        assert seen["during"] == "RUNNING", seen  # Slurm kept the job through the loss
        assert (info.state, info.status, info.restarts) == ("COMPLETED", 0, 0), (
            info.fields, out[-4000:])
        assert [(e["node"], e["group"]) for e in job.events("node_takeover")] == [(2, 1)]
        assert_same_final(reference[0], job)
        # Slurm's own reaction: node 1 is down (no slurmd answers), and left the job
        assert cluster.node_states().get("n1", "").startswith("down"), cluster.node_states()
    finally:
        cluster.start_node(1)  # back for the next test: a new slurmd on n1
        cluster.wait_idle(60)


def test_lightning_demo_model_under_slurm_recovers_bit_identical(cluster, tmp_path):
    """Lightning's BoringModel, imported unchanged, in workers that inherit a Slurm
    step's variables: Lightning must take its ranks from torchrun's launch (it looks
    for that before Slurm's), and the job recovers a kill bit-identical."""
    script, args = "tests/lightning_scripts/demo_models.py", ("--model", "boring",
                                                              "--max-steps", "10")
    settings = ("recovery.heartbeat_timeout_s=3", "recovery.heartbeat_interval_s=0.5")
    ref_info, ref, ref_out = _submit(cluster, tmp_path / "ref", *settings, script=script,
                                     script_args=args, timeout_s=240)
    assert (ref_info.state, ref_info.status) == ("COMPLETED", 0), ref_out[-4000:]
    assert sorted(ref.finals()) == [0, 1, 2, 3], ref_out[-4000:]
    info, job, out = _submit(cluster, tmp_path / "run", *settings,
                             "recovery.fault=2:6:forward:sigkill", script=script,
                             script_args=args, timeout_s=240)
    assert (info.state, info.status) == ("COMPLETED", 0), out[-4000:]
    assert [e["rank"] for e in job.events("replacement_assigned")] == [2]
    assert_same_final(ref, job)


def test_scancel_term_persists_requeues_and_the_next_run_resumes_it(
        cluster, reference, tmp_path):
    """``scancel --signal=TERM`` (a preemption, or the time limit's --signal): every
    node persists the newest committed step and exits 75, the batch script requeues
    the job, and its next run resumes from that step, bit-identical to a run never
    stopped."""
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"

    def term_then_release(job_id: str) -> None:
        wait_events(run_dir, lambda ev: any(e.get("event") == "step" and e["step"] >= 10
                                             for e in ev), "training to reach step 10", 120)
        cluster.client("scancel", "--signal=TERM", job_id)
        deadline = time.monotonic() + 90
        while cluster.job(job_id).restarts < 1:  # the batch script requeued it
            assert time.monotonic() < deadline, cluster.job(job_id).fields
            time.sleep(0.2)

    info, job, out = _submit(
        cluster, run_dir, f"persistence.path={ckpt}", "persistence.every_n_steps=1000",
        script_args=(*TRAIN_ARGS, "--step-sleep", "0.3"), during=term_then_release,
        timeout_s=300)
    assert (info.state, info.status, info.restarts) == ("COMPLETED", 0, 1), (
        info.fields, out[-4000:])
    drained = job.events("drained")
    assert sorted(e["rank"] for e in drained) == [0, 1, 2, 3], out[-4000:]
    steps = {e["step"] for e in drained}
    assert len(steps) == 1 and {e["persisted"] for e in drained} == steps, drained
    assert [e["step"] for e in job.events("durable_resume")][:1] == list(steps)
    assert f"requeueing job {info.job_id} (exit 75)" in out, out[-4000:]
    assert_same_final(reference[0], job)


def test_a_lost_agent_does_not_fail_a_job_the_others_finish(cluster, reference, tmp_path):
    """Node 1's agent and workers SIGKILLed while its slurmd lives: srun reports the
    task's 137 as the step's status, but the batch script reads every node's own
    (CHECKPOINTLESS_STATUS_FILE): the spare node finished the job, so it is COMPLETED."""
    info, job, out = _submit(cluster, tmp_path / "run", *FAST_DETECTION,
                             "recovery.fault=2:8:snapshot:node")
    assert [(e["node"], e["group"]) for e in job.events("node_takeover")] == [(2, 1)]
    assert (info.state, info.status) == ("COMPLETED", 0), (info.fields, out[-4000:])
    statuses = {p.name: p.read_text().strip() for p in (tmp_path / "run").glob("status.node*")}
    assert statuses == {"status.node0": "0", "status.node2": "0"}, statuses
    assert_same_final(reference[0], job)
