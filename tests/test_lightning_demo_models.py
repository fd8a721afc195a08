"""Lightning's own demo models, imported unchanged from the package, under
``Trainer(strategy="checkpointless")`` and ``checkpointless run`` (2 nodes x 2 workers).

A worker is SIGKILLed in the middle of a training step. Lightning's own collectives
(the per-batch stop-flag broadcast of its epoch loop, DDP's gradient all-reduce) run on
the runtime's process group, so the survivors must notice within a few heartbeat
periods, never the collective timeout; the run must end bit-identical to the
failure-free one: weights and optimizer, global step, and the hash of every batch each
rank trained on (a stateful callback, restored from Lightning's checkpoint dictionary).
"""

from __future__ import annotations

import pytest

from tests.recovery_harness import (
    assert_noticed_fast,
    assert_same_final,
    assert_succeeded,
    run_job,
)

pytestmark = pytest.mark.timeout(400)

SCRIPT = "tests/lightning_scripts/demo_models.py"
STEPS = 12
SETTINGS = ("recovery.heartbeat_timeout_s=3", "recovery.heartbeat_interval_s=0.5",
            "recovery.collective_timeout_s=60")


def _args(model: str) -> tuple[str, ...]:
    return ("--model", model, "--max-steps", str(STEPS))


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    out = {}
    for model in ("boring", "transformer"):
        job = run_job(tmp_path_factory.mktemp(f"ref_{model}"), nnodes=2, nproc=2,
                      script=SCRIPT, script_args=_args(model), overrides=SETTINGS,
                      timeout_s=300)
        assert_succeeded(job)
        assert not job.events("recovery"), "the reference run recovered from something"
        finals = job.finals()
        assert sorted(finals) == [0, 1, 2, 3]
        assert {f["step"] for f in finals.values()} == {STEPS}
        out[model] = job
    return out


@pytest.mark.parametrize("model,fault", [
    ("boring", "2:6:forward:sigkill"),        # the other node, inside training_step
    ("boring", "0:5:optimizer:sigkill"),      # rank 0, on the store host's node
    ("transformer", "1:6:backward:sigkill"),  # in DDP's gradient all-reduce
    ("transformer", "3:7:forward:sigkill"),
])
def test_demo_model_survives_a_kill_mid_step(tmp_path, references, model, fault):
    job = run_job(tmp_path / "run", nnodes=2, nproc=2, script=SCRIPT,
                  script_args=_args(model), overrides=(*SETTINGS, f"recovery.fault={fault}"),
                  timeout_s=300)
    assert_succeeded(job)
    assert len(job.events("fault_injected")) == 1, job.output()
    assert_noticed_fast(job, victim=int(fault.split(":")[0]))
    assert_same_final(references[model], job)
    causes = [e["cause"].get("error", "") for e in job.events("failure_detected")]
    assert not any("timed out" in c.lower() or "timeout" in c.lower() for c in causes), causes
