"""A replacement that builds its objects unlike the rank it replaces stops the job with one
line, at once: not a recovery retried until "recovery is not converging".

The mistake met first with a Hugging Face model: built on the meta device and moved with
``to_empty()``, its tied output layer gets storage of its own, so its optimizer holds
one parameter more than the snapshot it receives.
"""

from __future__ import annotations

import pytest
import torch

from replication.training_state.state import StateMismatch, TrainingState
from tests.recovery_harness import run_job

FAST = ("recovery.heartbeat_timeout_s=3", "recovery.heartbeat_interval_s=0.5")


def _tied() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight
    return model


def test_an_optimizer_built_over_other_parameters_is_named_with_the_remedy() -> None:
    model = _tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    captured = TrainingState()
    captured.register("model", model)
    captured.register("optimizer", opt)
    states = captured.capture()
    with torch.device("meta"):
        again = _tied()
    again = again.to_empty(device="cpu")  # untied: two parameters where there was one
    other = TrainingState()
    other.register("model", again)
    other.register("optimizer", torch.optim.SGD(again.parameters(), lr=0.1))
    with pytest.raises(StateMismatch, match=r"'optimizer' \(SGD\) cannot take the snapshot's "
                                            r"values \(ValueError: .*tie_weights"):
        other.restore(states)


def test_an_untied_replacement_stops_the_job_with_one_line(tmp_path) -> None:
    job = run_job(tmp_path / "run", nnodes=2, spares=1,
                  script="tests/user_scripts/untied_replacement.py", script_args=(),
                  timeout_s=120, overrides=["recovery.fault=1:6:backward:sigkill", *FAST])
    assert not job.timed_out, job.output()
    failed = job.events("job_failed")  # each agent's
    assert failed, job.output()
    reason = failed[0]["reason"]
    assert "'optimizer'" in reason and "tie_weights()" in reason, reason
    assert "not converging" not in reason, reason
    # Stopped in the first recovery, not retried.
    assert len(job.events("failure_declared")) <= 2, job.events("failure_declared")
