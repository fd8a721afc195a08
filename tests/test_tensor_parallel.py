"""Tensor parallelism (DTensor's ``parallelize_module``) alone and with FSDP2, under
``checkpointless run``: the job written as PyTorch's tensor-parallel tutorial writes it
(``examples/train_llama.py``: a small Llama, ``init_device_mesh`` with no
``init_process_group`` of its own, column-/row-wise plans per block, sequence
parallelism on the norms, ``fully_shard`` over ``dp``), on real processes over gloo.

- A ``(dp 2, tp 2)`` mesh on 2 nodes x 2 workers: each node holds one data-parallel
  replica's two tensor-parallel ranks, so a node loss takes a whole ``tp`` group.
- Killed in the forward (the survivors wait in sequence parallelism's first
  all-gather), in the backward (in TP's reduce-scatters and FSDP2's), at the optimizer
  step, and by the loss of a node: each recovered run ends bit-identical to the
  failure-free one (every rank's shards and AdamW moments, data order, every step's
  loss).
- TP alone (``dp 1``, no sequence parallelism), one rank per node, killed mid-backward.
- No spare and a node lost: shrinking a tensor-parallel layout is not built, so the job
  stops with one line that names why and exits 75; run again, it resumes from its
  durable checkpoint and ends bit-identical.
"""

from __future__ import annotations

from typing import Any

import pytest

from launcher.node_loss import TAKEOVER_PATIENCE
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
TWO_D = ("--dp", "2", "--tp", "2", "--steps", str(STEPS))
TP_ONLY = ("--dp", "1", "--tp", "2", "--no-sp", "--steps", str(STEPS))


def _same_losses(reference: JobResult, job: JobResult) -> None:
    ref, got = reference.finals(), job.finals()
    for rank in sorted(ref):
        assert len(ref[rank]["losses"]) == STEPS, "a step's loss is missing"
        assert got[rank]["losses"] == ref[rank]["losses"], f"rank {rank}'s losses differ"


def _recovered_once(job: JobResult) -> list[dict[str, Any]]:
    recs = job.events("recovery")
    assert recs, "no recovery happened"
    assert len({e["gen"] for e in recs}) == 1, f"more than one recovery: {recs}"
    return recs


@pytest.fixture(scope="module")
def two_d_reference(tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    job = run_job(tmp_path_factory.mktemp("tp2d_ref"), nnodes=2, nproc=2, script=SCRIPT,
                  script_args=TWO_D, overrides=SETTINGS, timeout_s=240)
    assert_succeeded(job)
    assert not job.events("recovery"), "the reference run recovered from something"
    finals = job.finals()
    assert sorted(finals) == [0, 1, 2, 3] and {f["step"] for f in finals.values()} == {STEPS}
    assert len({f["digest"] for f in finals.values()}) == 4  # every rank its own shards
    # the two ranks of a tp group compute the same replicated loss; the dp groups differ
    assert finals[0]["losses"] == finals[1]["losses"] != finals[2]["losses"]
    assert finals[2]["losses"] == finals[3]["losses"]
    assert finals[0]["losses"][-1] < finals[0]["losses"][0], "the model did not learn"
    return job


def test_init_device_mesh_alone_builds_the_mesh_on_the_runtimes_group(
        two_d_reference: JobResult) -> None:
    """The script never calls ``init_process_group``; ``init_device_mesh`` did, through
    its own import of it, and got the runtime's group (it once got torch's default and
    the job stopped at ``Checkpointless(...)``): the fixture's job finished."""
    assert "not made by checkpointless" not in two_d_reference.output()
    assert len(two_d_reference.events("job_done")) == 2, two_d_reference.output()


@pytest.mark.parametrize("fault", [
    "1:4:forward:sigkill",     # tp partner of rank 0, same node: SP's first all-gather
    "2:5:backward:sigkill",    # the other node: TP's and FSDP2's backward collectives
    "3:3:optimizer:sigkill",   # after every gradient collective of the step
])
def test_two_d_survives_a_kill(tmp_path: Any, two_d_reference: JobResult, fault: str) -> None:
    job = run_job(tmp_path / "run", nnodes=2, nproc=2, spares=1, script=SCRIPT,
                  script_args=TWO_D, overrides=(*SETTINGS, f"recovery.fault={fault}"),
                  timeout_s=240)
    assert_succeeded(job)
    victim = int(fault.split(":")[0])
    assert_noticed_fast(job, victim=victim)
    recs = _recovered_once(job)
    assert {e["rank"] for e in recs if e["newcomer"]} == {victim}, recs
    assert_same_final(two_d_reference, job)
    _same_losses(two_d_reference, job)


def test_two_d_survives_the_loss_of_a_node(tmp_path: Any, two_d_reference: JobResult) -> None:
    """Node 1 (ranks 2 and 3: dp replica 1's whole tp group) dies at rank 2's optimizer
    step; the spare node takes both ranks, which receive their shards from node 0."""
    job = run_job(tmp_path / "run", nnodes=2, nproc=2, spare_nodes=1, script=SCRIPT,
                  script_args=TWO_D,
                  overrides=(*SETTINGS, "recovery.fault=2:5:optimizer:node"), timeout_s=240)
    assert job.returncodes[1] == -9, f"node 1's agent should be SIGKILLed: {job.returncodes}"
    assert_succeeded(job, except_nodes=(1,))
    recs = _recovered_once(job)
    assert {e["rank"] for e in recs if e["newcomer"]} == {2, 3}, recs
    assert_same_final(two_d_reference, job)
    _same_losses(two_d_reference, job)


def test_tensor_parallel_alone_survives_a_kill(tmp_path_factory: pytest.TempPathFactory
                                               ) -> None:
    """TP alone on 2 ranks, one per node (each rank's shards exist nowhere else on its
    node): rank 1 is killed mid-backward and its replacement receives its shards from
    node 0's replica of them."""
    reference = run_job(tmp_path_factory.mktemp("tp_ref"), nnodes=2, nproc=1, script=SCRIPT,
                        script_args=TP_ONLY, overrides=SETTINGS, timeout_s=240)
    assert_succeeded(reference)
    finals = reference.finals()
    assert finals[0]["digest"] != finals[1]["digest"]  # two halves of every weight
    assert finals[0]["losses"] == finals[1]["losses"]
    job = run_job(tmp_path_factory.mktemp("tp_kill"), nnodes=2, nproc=1, spares=1,
                  script=SCRIPT, script_args=TP_ONLY,
                  overrides=(*SETTINGS, "recovery.fault=1:5:backward:sigkill"), timeout_s=240)
    assert_succeeded(job)
    recs = _recovered_once(job)
    assert {e["rank"] for e in recs if e["newcomer"]} == {1}, recs
    assert_same_final(reference, job)
    _same_losses(reference, job)


def test_a_node_lost_with_no_spare_stops_with_one_line_and_a_new_run_resumes_exactly(
        tmp_path: Any, two_d_reference: JobResult) -> None:
    """No spare node: a shrink would have to re-lay tensor-parallel shards onto fewer
    ranks, which is not built. The surviving agent ends the job (exit 75, "a new run can
    go on from the durable checkpoint") with one line naming the parameter whose layout
    cannot shrink, as soon as the lost node can no longer come back.

    The same command run again resumes from the durable tier's newest complete
    checkpoint (step 2: step 4's saves were cut short by the loss; DCP's format, every
    rank's own shards) and ends bit-identical to the failure-free run, every logged loss
    included (the loss log is part of the state)."""
    durable = (f"persistence.path={tmp_path / 'ckpt'}", "persistence.every_n_steps=2",
               "replication.every_n_steps=1")
    job = run_job(tmp_path / "run", nnodes=2, nproc=2, script=SCRIPT, script_args=TWO_D,
                  overrides=(*SETTINGS, *durable, "recovery.fault=2:5:optimizer:node"),
                  timeout_s=120)
    assert job.returncodes[1] == -9, job.returncodes
    assert job.returncodes[0] == 75, job.output()
    failed = [line for line in job.output().splitlines() if "job failed" in line]
    assert len(failed) == 1, job.output()
    assert "cannot shrink" in failed[0] and "tok_embeddings.weight" in failed[0], failed
    lost, failed_ev = job.events("node_lost"), job.events("job_failed")
    assert lost and failed_ev, job.output()
    # The verdict comes once a lost node may no longer come back (TAKEOVER_PATIENCE
    # heartbeat timeouts: one only starved resumes and keeps its ranks), never after a
    # collective timeout; 5 s of slack for a loaded host.
    patience_s = TAKEOVER_PATIENCE * 3.0
    assert failed_ev[0]["ts"] - lost[0]["ts"] < patience_s + 5.0, (lost, failed_ev)

    again = run_job(tmp_path / "again", nnodes=2, nproc=2, script=SCRIPT, script_args=TWO_D,
                    overrides=(*SETTINGS, *durable), timeout_s=240)
    assert_succeeded(again)
    resumed = [line for line in again.output().splitlines() if "resuming" in line]
    assert resumed and "restored step" in resumed[0], again.output()
    first_step = min(e["step"] for e in again.events("step"))
    assert first_step > 1, f"the new run trained from step {first_step}"
    assert_same_final(two_d_reference, again)
    _same_losses(two_d_reference, again)
