"""Pipeline parallelism (``torch.distributed.pipelining``) under ``checkpointless run``:
``examples/train_llama.py --pp 2`` splits a small Llama into two stages by hand (the
embeddings and the first block on stage 0, the second block, the final norm and the
output on stage 1), one ``PipelineStage`` per rank, run by ``ScheduleGPipe`` or
``Schedule1F1B`` over 4 micro-batches; its mesh comes from ``init_device_mesh`` alone.

- Two stages on 2 nodes x 1 worker: the last stage killed in the backward (the first
  waits in a P2P receive of its gradients), and, under 1F1B, the first stage killed in
  the forward (the last waits for its activations).
- Two stages x FSDP2 over 2 data-parallel ranks on 2 nodes x 2 workers: node 1 (both
  ranks of stage 1) lost mid-backward, a spare node takes it over.

- ``ScheduleInterleaved1F1B`` (several stages per rank): its recovery is not built, and
  the job stops with one line naming the schedule.

Each run ends bit-identical to its failure-free one: every rank's parameters and AdamW
state, data order, and the last stage's loss at every step. Each survivor's schedule was
marked unprepared (``pipeline_schedules_reset``): a replacement's new schedule exchanges
stage metadata at its first step, and without that the survivors sent a micro-batch
where it waited for metadata, and gloo aborted it at every try.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.recovery_harness import (
    JobResult,
    assert_noticed_fast,
    assert_same_final,
    assert_succeeded,
    run_job,
)

pytestmark = pytest.mark.timeout(400)

SCRIPT = "examples/train_llama.py"
STEPS = 8
SETTINGS = ("recovery.heartbeat_timeout_s=3", "recovery.heartbeat_interval_s=0.5",
            "recovery.collective_timeout_s=30")


def _args(schedule: str, dp: int = 1) -> tuple[str, ...]:
    return ("--pp", "2", "--dp", str(dp), "--tp", "1", "--schedule", schedule,
            "--steps", str(STEPS))


def _reference(tmp: Any, schedule: str, dp: int) -> JobResult:
    job = run_job(tmp, nnodes=2, nproc=dp, script=SCRIPT, script_args=_args(schedule, dp),
                  overrides=SETTINGS, timeout_s=240)
    assert_succeeded(job)
    assert not job.events("recovery"), "the reference run recovered from something"
    finals = job.finals()
    assert {f["step"] for f in finals.values()} == {STEPS}
    last = [r for r in finals if r >= dp]  # stage 1's ranks: (pp, dp) row-major
    assert all(len(finals[r]["losses"]) == STEPS for r in last), finals
    assert all(finals[r]["losses"] == [] for r in finals if r < dp), "stage 0 has no loss"
    assert finals[last[0]]["losses"][-1] < finals[last[0]]["losses"][0], "it did not learn"
    return job


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, JobResult]:
    return {name: _reference(tmp_path_factory.mktemp(f"pp_ref_{name}"), schedule, dp)
            for name, schedule, dp in (("gpipe", "gpipe", 1), ("1f1b", "1f1b", 1),
                                       ("gpipe_dp", "gpipe", 2))}


def _check(reference: JobResult, job: JobResult, newcomers: set[int]) -> None:
    recs = job.events("recovery")
    assert recs and len({e["gen"] for e in recs}) == 1, f"not exactly one recovery: {recs}"
    assert {e["rank"] for e in recs if e["newcomer"]} == newcomers, recs
    survivors = [e for e in recs if not e["newcomer"]]
    assert survivors and all(e["pipeline_schedules_reset"] == 1 for e in survivors), survivors
    assert_same_final(reference, job)
    ref, got = reference.finals(), job.finals()
    assert all(got[r]["losses"] == ref[r]["losses"] for r in ref), "a step's loss differs"


@pytest.mark.parametrize("schedule,fault", [
    ("gpipe", "1:4:backward:sigkill"),  # stage 0 waits to receive gradients
    ("1f1b", "0:5:forward:sigkill"),    # stage 1 waits to receive activations
])
def test_a_stage_killed_mid_step(tmp_path: Any, references: dict[str, JobResult],
                                 schedule: str, fault: str) -> None:
    job = run_job(tmp_path / "run", nnodes=2, nproc=1, spares=1, script=SCRIPT,
                  script_args=_args(schedule), overrides=(*SETTINGS, f"recovery.fault={fault}"),
                  timeout_s=240)
    assert_succeeded(job)
    victim = int(fault.split(":")[0])
    assert_noticed_fast(job, victim=victim)
    _check(references[schedule], job, {victim})


def test_a_stage_lost_with_its_node(tmp_path: Any, references: dict[str, JobResult]) -> None:
    """Stage 1's two data-parallel ranks (2 and 3) live on node 1, lost in rank 2's
    backward; the spare node runs both, from their FSDP2 shards' replicas on node 0."""
    job = run_job(tmp_path / "run", nnodes=2, nproc=2, spare_nodes=1, script=SCRIPT,
                  script_args=_args("gpipe", dp=2),
                  overrides=(*SETTINGS, "recovery.fault=2:5:backward:node"), timeout_s=240)
    assert job.returncodes[1] == -9, f"node 1's agent should be SIGKILLed: {job.returncodes}"
    assert_succeeded(job, except_nodes=(1,))
    _check(references["gpipe_dp"], job, {2, 3})


def test_a_schedule_with_several_stages_per_rank_stops_with_one_line(tmp_path: Any) -> None:
    """``ScheduleInterleaved1F1B`` (two stages per rank, four in all) trains, but its
    recovery is not built: its replayed step failed inside torch and was reported as a
    bug in the step. At the recovery the survivors name the schedule and what to use
    instead, and every agent ends with exit 75 (the durable checkpoint can go on)."""
    job = run_job(tmp_path / "run", nnodes=2, nproc=1, spares=1, script=SCRIPT,
                  script_args=("--pp", "2", "--dp", "1", "--tp", "1", "--layers", "4",
                               "--schedule", "interleaved", "--steps", str(STEPS)),
                  overrides=(*SETTINGS, "recovery.fault=1:4:backward:sigkill"),
                  timeout_s=120)
    assert set(job.returncodes.values()) == {75}, job.output()
    assert job.events("fault_injected"), "the job ended before the fault"
    failed = [line for line in job.output().splitlines() if "job failed" in line]
    assert failed and all("ScheduleInterleaved1F1B" in line and "Schedule1F1B" in line
                          for line in failed), job.output()
    assert "Recv twice" not in job.output()
