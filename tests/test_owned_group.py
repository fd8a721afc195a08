"""The runtime owns the process group everyone uses (ADR 0015).

Real processes under the real launcher, 2 nodes x 2 workers, gloo on CPU: a DDP loop
written as the PyTorch docs write it (``init_process_group``, ``DistributedDataParallel``
built once) with the user's own blocking ``dist.broadcast`` every step. A SIGKILL on any
rank position, in any phase, must be detected by the survivors within a few heartbeat
periods (never the 60 s collective timeout), end bit-identical to the failure-free run,
and leave nothing of the failed generation running: the survivors' thread counts come
back to their pre-failure figure and their step times with them.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import pytest

from tests.recovery_harness import (
    REPO,
    assert_noticed_fast,
    assert_same_final,
    assert_succeeded,
    clean_env,
    free_port,
    run_job,
)

pytestmark = pytest.mark.timeout(300)

SCRIPT = "tests/launcher_scripts/ddp_user_loop.py"
ARGS = ("--steps", "30", "--step-sleep", "0.03")
SETTINGS = ("recovery.heartbeat_timeout_s=3", "recovery.heartbeat_interval_s=0.5",
            "recovery.collective_timeout_s=60")
FAULT_STEP = 12


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = run_job(tmp_path_factory.mktemp("ddp_reference"), nnodes=2, script=SCRIPT,
                  script_args=ARGS, overrides=SETTINGS, timeout_s=150)
    assert_succeeded(job)
    assert not job.events("recovery")
    return job


@pytest.mark.parametrize("fault", [
    f"0:{FAULT_STEP}:backward:sigkill",   # the store host's node, rank 0, in DDP's all-reduce
    f"3:{FAULT_STEP}:forward:sigkill",    # the other node
    f"1:{FAULT_STEP}:step:sigkill",       # before the step: survivors sit in dist.broadcast
    f"2:{FAULT_STEP}:optimizer:sigkill",
])
def test_user_ddp_survives_a_kill(tmp_path, reference, fault):
    job = run_job(tmp_path / "run", nnodes=2, script=SCRIPT, script_args=ARGS,
                  overrides=(*SETTINGS, f"recovery.fault={fault}"), timeout_s=150)
    assert_succeeded(job)
    assert_same_final(reference, job)
    victim = int(fault.split(":")[0])
    assert_noticed_fast(job, victim)
    recs = [e for e in job.events("recovery") if not e["newcomer"]]
    assert recs and all(e["ddp_modules_reset"] == 1 for e in recs)
    newcomer = [e for e in job.events("recovery") if e["newcomer"]]
    assert newcomer and newcomer[0]["local_collectives"] >= 1  # DDP's constructor broadcast

    finals = job.finals()
    for rank, final in finals.items():
        if rank == victim:
            continue
        names = {int(k): v for k, v in final["thread_names"].items()}
        assert FAULT_STEP - 2 in names, (
            f"rank {rank} never ran step {FAULT_STEP - 2}: the process that finished started "
            f"after the failure, so a survivor died too\n{job.output()}")
        before, after = names[FAULT_STEP - 2], names[max(names)]
        workers = (before.count("pt_gloo_runloop"), after.count("pt_gloo_runloop"))
        assert workers[1] <= workers[0], (
            f"rank {rank}: {workers[1]} gloo worker threads at the end against {workers[0]} "
            f"before the failure: a failed generation's group is still alive\n{after}")
        # Known leftover (docs/guide/limits.md): the abandoned replication round keeps its channel's
        # idle event-loop thread until its commit wait ends, plus the runtime's reaper.
        assert len(after) <= len(before) + 2, (
            f"rank {rank}: threads before the failure {before}, at the end {after}")
        times = {int(k): v for k, v in final["step_times"].items()}
        pre = statistics.median(times[s] for s in range(3, FAULT_STEP - 1))
        post = statistics.median(times[s] for s in range(FAULT_STEP + 4, max(times) + 1))
        assert post <= 1.5 * pre, (
            f"rank {rank}: median step {post * 1e3:.1f} ms after the recovery against "
            f"{pre * 1e3:.1f} ms before")


def test_plain_torchrun_environment_gets_one_line(tmp_path):
    """RANK/WORLD_SIZE set without `checkpointless run` (what torchrun gives): one line."""
    env = clean_env()
    env.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="1")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "examples/train_gpt.py", "--steps", "2"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60)
    assert time.monotonic() - t0 < 30
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "without `checkpointless run`" in lines[0] and "rank 0 of 2" in lines[0]


def test_standalone_single_process_still_runs(tmp_path):
    """`python train.py` alone (no launcher, world of one) keeps working."""
    env = clean_env()
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, "examples/train_ddp.py", "--steps", "3",
                           "--out", str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert os.path.exists(tmp_path / "final_rank0.json")
