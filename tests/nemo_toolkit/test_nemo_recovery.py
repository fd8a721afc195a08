"""NeMo under ``checkpointless run``: a kill during ``fit`` recovered in-process.

The job is ``examples/nemo_gpt.py``: a small GPT as a NeMo ``ModelPT``, trained through
NeMo's flow (``hydra_runner``, ``exp_manager``, the Trainer instantiated from the
``trainer:`` section of ``examples/nemo_gpt.yaml``, whose strategy is the checkpointless
one as a ``_target_`` entry and which nests the ``checkpointless:`` block). Every
recovered run must end bit-identical to the failure-free run: model and optimizer
digest, step, and the hash of every batch each rank trained on, in order.

Runs in the NeMo environment only (``make test-nemo``; see tests/conftest.py).
"""

from __future__ import annotations

import pytest

from tests.recovery_harness import (
    assert_recovered,
    assert_same_final,
    assert_succeeded,
    run_job,
)

pytestmark = pytest.mark.timeout(420)

SCRIPT = "examples/nemo_gpt.py"
RECIPE = ("--recipe", "examples/nemo_gpt.yaml")
STEPS = 24  # 96 samples / (2 ranks x batch 4) x 2 epochs


def _args(run_dir, *extra: str) -> tuple[str, ...]:
    return (f"exp_manager.exp_dir={run_dir}/nemo_experiments", *extra)


def _job(run_dir, *, faults: str = "", spares: int = 1, extra: tuple[str, ...] = (),
         overrides: tuple[str, ...] = ()):
    overrides = [*RECIPE, *([f"recovery.fault={faults}"] if faults else []), *overrides]
    return run_job(run_dir, nnodes=1, nproc=2, spares=spares, script=SCRIPT,
                   script_args=_args(run_dir, *extra), overrides=overrides, timeout_s=300)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = _job(tmp_path_factory.mktemp("reference"), spares=0)
    assert_succeeded(job)
    assert not job.events("recovery"), "the reference run recovered from something"
    assert {f["step"] for f in job.finals().values()} == {STEPS}
    return job


def test_worker_sigkill_during_fit_ends_bit_identical(tmp_path, reference):
    """With every optimizer-owned tensor's copy overlapped with the next step (the toy
    model's tensors are all under the default ``overlap_min_bytes``), against a
    reference whose snapshots copy everything in the loop."""
    job = _job(tmp_path / "run", faults="1:5:backward",
               overrides=("replication.overlap_min_bytes=0",))
    assert_succeeded(job)
    assert_same_final(reference, job)
    assert_recovered(job, faults=1)
    # NeMo's optimizer reaches the engine through the strategy's declaration: without
    # it nothing would be overlapped.
    # A live rollback (ADR 0039) commits its step inside the recovery, from a snapshot
    # already copied or one captured with nothing to overlap with: that round is left out.
    live = {e["target_step"] for e in job.events("recovery") if e["live"]}
    rounds = [e["replicated"] for e in job.events("step")
              if e.get("replicated") and e["replicated"]["step"] not in live]
    assert rounds and all(r["overlapped_bytes"] > 0 for r in rounds), rounds[:3]
    # NeMo's telemetry would refuse a second training-loop span: the attempt after the
    # recovery must not have failed again.
    assert len({e["gen"] for e in job.events("recovery")}) == 1, job.events("recovery")


def test_kill_during_validation_ends_bit_identical(tmp_path, reference):
    job = _job(tmp_path / "run", extra=("model.kill_in_validation=1:8",))
    assert_succeeded(job)
    assert_same_final(reference, job)
    exits = [e for e in job.events("worker_exit") if e.get("signal") == "SIGKILL"]
    assert [e["rank"] for e in exits] == [1], exits
    assert job.events("recovery"), "no recovery after the kill in validation"
