"""DeepSpeed ZeRO jobs under the real launcher: ``examples/train_deepspeed.py``.

The loop is DeepSpeed's own (``init_distributed``, ``initialize`` with a client AdamW, a
cosine schedule, gradient clipping, 2 micro-batches per optimizer step with
``engine(x)``, ``engine.backward(loss)``, ``engine.step()``), on 2 nodes x 2 ranks over
gloo. A worker killed in the forward, in the backward (ZeRO's gradient reduction runs in
its hooks) or in ``engine.step()``, and a whole node lost, each end bit-identical to the
failure-free run: the weights, every rank's partition of the AdamW state and of the fp32
master weights, the engine's counters, the learning rate, the data order and every
step's loss. ``engine.save_checkpoint`` goes through the runtime (asynchronous, atomic,
checksummed) and plain DeepSpeed resumes what it wrote.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.mp import free_port
from tests.recovery_harness import assert_failed_cleanly, assert_succeeded, run_job

ROOT = Path(__file__).resolve().parent.parent

if importlib.util.find_spec("deepspeed") is None:  # CI installs it: missing there is a failure
    if os.environ.get("TESTS_REQUIRE_DEEPSPEED"):
        raise RuntimeError("TESTS_REQUIRE_DEEPSPEED is set but deepspeed is not installed")
    pytest.skip("deepspeed is not installed (make setup installs it)", allow_module_level=True)

pytestmark = pytest.mark.timeout(400)

SCRIPT = "examples/train_deepspeed.py"
FAST = ("recovery.heartbeat_timeout_s=3", "recovery.heartbeat_interval_s=0.5")
FINAL = ("step", "digest", "global_steps", "micro_steps", "global_samples", "lr",
         "data_order", "position", "losses")
FAULTS = {  # 16 optimizer steps an epoch on 4 ranks, two epochs; snapshots every 8
    "forward_kill": "1:5:forward:sigkill",
    "backward_kill": "2:13:backward:sigkill",
    "step_kill": "3:20:optimizer:sigkill",
    "node_loss": "2:27:optimizer:node",
}


@pytest.fixture(scope="module", params=[1, 2], ids=["zero1", "zero2"])
def reference(request, tmp_path_factory):
    stage = request.param
    job = run_job(tmp_path_factory.mktemp(f"reference{stage}"), nnodes=2, script=SCRIPT,
                  script_args=("--stage", str(stage)), timeout_s=200)
    assert_succeeded(job)
    assert not job.events("recovery"), "the reference run recovered from something"
    return stage, job


def _same(reference, job) -> None:
    ref, got = reference.finals(), job.finals()
    assert sorted(got) == sorted(ref) == [0, 1, 2, 3], (sorted(got), job.output())
    for rank in ref:
        for key in FINAL:
            assert got[rank][key] == ref[rank][key], (
                f"rank {rank}: {key} differs from the failure-free run")
    assert len({ref[r]["digest"] for r in ref}) == 4, "the ZeRO partitions should differ"


@pytest.mark.parametrize("fault", list(FAULTS), ids=list(FAULTS))
def test_a_zero_job_recovers_bit_identically(tmp_path, reference, fault):
    stage, ref = reference
    node_loss = fault == "node_loss"
    job = run_job(tmp_path / "run", nnodes=2, spares=1, spare_nodes=1 if node_loss else 0,
                  script=SCRIPT, script_args=("--stage", str(stage)), timeout_s=250,
                  overrides=[f"recovery.fault={FAULTS[fault]}", *FAST])
    assert_succeeded(job, except_nodes=(1,) if node_loss else ())
    assert job.events("fault_injected"), "the fault never fired"
    assert job.events("recovery"), "nothing was recovered"
    _same(ref, job)


@pytest.mark.parametrize("reference", [2], indirect=True, ids=["zero2"])
def test_a_node_lost_with_no_spare_stops_with_one_line_and_a_new_run_resumes_exactly(
        tmp_path, reference):
    """No spare node: a DeepSpeed engine is built for its world (ZeRO's partitions, the
    train_batch_size), so the job cannot shrink. The surviving agent ends it with one line
    that says why and what to do (exit 75), never after a collective timeout.

    The same command run again resumes from the runtime's durable checkpoint (every
    rank's own ZeRO partitions, written every 2 steps) and ends bit-identical to the
    failure-free run, every logged loss included."""
    durable = (f"persistence.path={tmp_path / 'ckpt'}", "persistence.every_n_steps=2")
    job = run_job(tmp_path / "run", nnodes=2, script=SCRIPT, script_args=("--stage", "2"),
                  timeout_s=150,
                  overrides=["recovery.fault=2:11:optimizer:node", *FAST, *durable])
    assert not job.timed_out, job.output()
    assert job.returncodes[0] == 75, job.output()
    failed = [line for line in job.output().splitlines() if "job failed" in line]
    assert len(failed) == 1, job.output()
    assert "DeepSpeed engine is built for 4 data-parallel ranks" in failed[0], failed
    assert "add a spare node" in failed[0], failed

    again = run_job(tmp_path / "again", nnodes=2, script=SCRIPT,
                    script_args=("--stage", "2"), timeout_s=200, overrides=[*FAST, *durable])
    assert_succeeded(again)
    resumed = [line for line in again.output().splitlines() if "resuming" in line]
    assert resumed and "restored step" in resumed[0], again.output()
    first_step = min(e["step"] for e in again.events("step"))
    assert first_step > 1, f"the new run trained from step {first_step}"
    _same(reference[1], again)


def test_zero_stage_3_is_refused_with_one_line(tmp_path):
    """Stage 3 partitions the parameters too (gathered per layer by hooks the runtime does
    not reset yet): refused at ``Checkpointless(engine=...)``, before any step."""
    job = run_job(tmp_path / "run", nnodes=1, script=SCRIPT, script_args=("--stage", "3"),
                  timeout_s=120)
    assert_failed_cleanly(job)
    failed = [line for line in job.output().splitlines() if "job failed" in line]
    assert len(failed) == 1 and "ZeRO stage 3 is not supported" in failed[0], job.output()
    assert "not retried" in failed[0], failed


def test_a_step_ending_inside_the_accumulation_is_named_at_once(tmp_path):
    """A loop that wraps each micro-batch in its own ``cl.training_step()`` (one runtime
    step per micro-batch) would snapshot ZeRO in the middle of an accumulation whenever the
    interval lands on an odd step. The first such step (step 1, before any snapshot) stops
    the job with one line that says how to write the step, not retried."""
    job = run_job(tmp_path / "run", nnodes=1, script=SCRIPT,
                  script_args=("--stage", "2", "--per-micro-batch-steps"), timeout_s=120)
    assert_failed_cleanly(job)
    failed = [line for line in job.output().splitlines() if "job failed" in line]
    assert len(failed) == 1, job.output()
    assert "micro-step 1 of DeepSpeed's 2-step gradient accumulation" in failed[0], failed
    assert not job.events("recovery"), "a user's loop error was retried"
    assert "(micro-step 1 in all)" in failed[0], failed  # the first step, not a later one
    assert "script's own error" in failed[0], failed  # exit 93: a rerun fails the same way


def test_save_checkpoint_is_atomic_and_plain_deepspeed_resumes_it_exactly(tmp_path, capsys):
    """``engine.save_checkpoint(dir)`` every 10 steps, unchanged, under the runtime; rank 1
    is SIGKILLed once its files of ``global_step20`` are written but before it says so
    (the ``save`` fault phase). The tag never appears half written and ``latest`` never
    names it; the replay commits it again. Plain DeepSpeed (``torch.distributed.run``,
    no runtime) then loads ``latest`` and trains on to the same losses, weights, optimizer
    partitions and fp32 master weights as the runtime's run (a job whose steps draw no
    random numbers: DeepSpeed's own checkpoints restore no RNG stream)."""
    from launcher.cli import main

    save_dir = tmp_path / "ds_ckpt"
    args = ("--stage", "2", "--epochs", "1", "--no-rng", "--save-dir", str(save_dir),
            "--save-every", "10")
    job = run_job(tmp_path / "run", nnodes=1, spares=1, script=SCRIPT, script_args=args,
                  timeout_s=200, overrides=["recovery.fault=1:20:save:sigkill", *FAST])
    assert_succeeded(job)
    (fired,) = job.events("fault_injected")
    assert fired["phase"] == "save" and fired["step"] == 20, fired
    assert job.events("recovery"), "nothing was recovered"
    saved = {(e["tag"], e["attempt"]): e for e in job.events("tagged_checkpoint")
             if e["rank"] == 0}
    cut = [e for (tag, _), e in saved.items() if tag == "global_step20" and not e["committed"]]
    assert cut, f"the save rank 1 died in was committed anyway: {sorted(saved)}"
    assert {tag for (tag, _), e in saved.items() if e["committed"]} == {
        "global_step10", "global_step20", "global_step30"}, sorted(saved)
    assert all(e["waited_s"] < 5 and e["serialize_s"] < 5 for e in saved.values()), saved
    assert (save_dir / "latest").read_text() == "global_step30"
    assert not [p.name for p in save_dir.iterdir() if ".partial-" in p.name]
    assert main(["ckpt", "list", "--all", "--json", str(save_dir)]) == 0
    listed = json.loads(capsys.readouterr().out)["checkpoints"]
    assert [(c["step"], c["status"]) for c in listed] == [(10, "valid"), (20, "valid"),
                                                          (30, "valid")], listed
    assert main(["ckpt", "verify", str(save_dir / "global_step30")]) == 0, capsys.readouterr()

    out = tmp_path / "plain"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("CHECKPOINTLESS_")}
    plain = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), "tests/user_scripts/deepspeed_plain_resume.py",
         *args, "--load-dir", str(save_dir), "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert plain.returncode == 0, plain.stderr[-3000:]
    finals = job.finals()
    for rank in (0, 1):
        got = json.loads((out / f"plain_rank{rank}.json").read_text())
        assert got["loaded_step"] == 30, got
        assert got["loaded"].startswith(str(save_dir / "global_step30")), got
        assert got["losses"] == finals[rank]["losses"][30:], rank
        assert got["digest"] == finals[rank]["digest"], f"rank {rank}: the state differs"
        assert got["global_steps"] == finals[rank]["global_steps"]
