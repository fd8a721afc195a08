"""Gradient accumulation as language-model loops write it, under the real launcher.

``examples/train_ddp_accumulate.py``: DDP, 2 micro-batches per step with ``no_sync()``
on the first, dropout, AdamW, a cosine schedule, ``clip_grad_norm_``, a shuffling
``DistributedSampler`` and a ``DataLoader`` with 2 workers, two epochs. The loop takes
its micro-batches with ``next()``, so it counts its own steps:

- through ``cl.steps(n)``, or with ``zip(*[iter(data)] * 2)``, a worker SIGKILL and a
  node loss end bit-identical to the failure-free run: weights, AdamW state, data order
  and every step's loss;
- with its own ``range(n)``, the ranks run different numbers of steps after a recovery,
  and the job stops with one line that names the cause (not "is a spare available?"
  after a 60 s rendezvous timeout, as before).
"""

from __future__ import annotations

import pytest

from tests.recovery_harness import assert_same_final, assert_succeeded, run_job

pytestmark = pytest.mark.timeout(400)

SCRIPT = "examples/train_ddp_accumulate.py"
FAST = ("recovery.heartbeat_timeout_s=3", "recovery.heartbeat_interval_s=0.5")
KILL = "1:5:backward:sigkill"  # mid-epoch 0 (8 steps an epoch on 4 ranks)
NODE = "2:11:optimizer:node"  # node 1 (ranks 2 and 3), mid-epoch 1


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = run_job(tmp_path_factory.mktemp("reference"), nnodes=2, script=SCRIPT,
                  script_args=("--counter", "steps"), timeout_s=200)
    assert_succeeded(job)
    assert not job.events("recovery"), "the reference run recovered from something"
    return job


def _same_losses(reference, job) -> None:
    ref, got = reference.finals(), job.finals()
    for rank in ref:
        assert got[rank]["losses"] == ref[rank]["losses"], f"rank {rank}'s step losses differ"
        assert len(ref[rank]["losses"]) == ref[rank]["step"], "a step's loss is missing"


@pytest.mark.parametrize("counter", ["steps", "zip"])
@pytest.mark.parametrize("fault", [KILL, NODE], ids=["worker_kill", "node_loss"])
def test_accumulation_recovers_bit_identically(tmp_path, reference, counter, fault):
    node_loss = fault == NODE
    job = run_job(tmp_path / "run", nnodes=2, spares=1, spare_nodes=1 if node_loss else 0,
                  script=SCRIPT, script_args=("--counter", counter), timeout_s=250,
                  overrides=[f"recovery.fault={fault}", *FAST])
    assert_succeeded(job, except_nodes=(1,) if node_loss else ())
    assert job.events("fault_injected"), "the fault never fired"
    assert job.events("recovery"), "nothing was recovered"
    assert_same_final(reference, job)
    _same_losses(reference, job)


def test_a_rollback_to_the_initial_state_replays_the_first_pass(tmp_path, reference):
    """Without live rollback the kill at step 5 rolls back to step 0: the initial state,
    committed before the loop opened its first pass. That used to stop the job ("the
    recovery went back to pass 0 over the loader while the loop is in pass 1"), for
    every job on the snapshot path (a sharded or DeepSpeed one) failing before its first
    snapshot. The first pass begins again, and the run ends bit-identical."""
    job = run_job(tmp_path / "run", nnodes=2, spares=1, script=SCRIPT,
                  script_args=("--counter", "steps"), timeout_s=250,
                  overrides=[f"recovery.fault={KILL}", "recovery.live_rollback=false", *FAST])
    assert_succeeded(job)
    assert {e["target_step"] for e in job.events("recovery")} == {0}, job.events("recovery")
    assert_same_final(reference, job)
    _same_losses(reference, job)


def test_a_loop_counting_its_own_steps_is_stopped_with_the_cause(tmp_path):
    """``for _ in range(n):`` with ``next()`` twice inside: after the kill, the
    replacement's counter starts at 0 while the loader resumes at the batch after the
    restored step, so it asks for a batch past the end of the epoch's data. That
    ``StopIteration`` is the loop's error, not a node's: one line, not retried."""
    job = run_job(tmp_path / "run", nnodes=2, spares=1, script=SCRIPT,
                  script_args=("--counter", "range"), timeout_s=200,
                  overrides=[f"recovery.fault={KILL}", *FAST])
    assert not job.timed_out, job.output()
    assert any(rc not in (0, None) for rc in job.returncodes.values()), job.output()
    fatal = job.events("job_failed")
    assert fatal, job.output()
    reason = fatal[0]["reason"]
    assert "cl.steps(n)" in reason and ("StopIteration" in reason
                                        or "finished training" in reason), reason
    assert "spare" not in reason, reason
    # At the first sign: within seconds of the recovery, never a rendezvous timeout.
    recovered = min(e["ts"] for e in job.events("recovery"))
    assert fatal[0]["ts"] - recovered < 10, (fatal[0]["ts"] - recovered, reason)


def test_a_pass_of_cl_steps_alone_is_the_whole_job(tmp_path):
    """``for i in cl.steps(12):`` with no ``cl.epochs``: the job finishes after it, and a
    kill mid-pass ends with the weights of the failure-free run (each step's input is its
    index, so a rank resumed at the wrong index would differ) and index 11 last."""
    script = "tests/user_scripts/steps_alone.py"
    ref = run_job(tmp_path / "ref", nnodes=2, script=script, script_args=(), timeout_s=120)
    assert_succeeded(ref)
    job = run_job(tmp_path / "run", nnodes=2, spares=1, script=script, script_args=(),
                  timeout_s=150, overrides=["recovery.fault=1:6:backward:sigkill", *FAST])
    assert_succeeded(job)
    assert job.events("recovery"), "nothing was recovered"
    assert_same_final(ref, job)
    assert {f["last_index"] for f in job.finals().values()} == {11}


def test_ranks_that_finished_while_another_trains_stop_the_job_at_once(tmp_path):
    """The survivors of a kill finish their own ``range`` first and exit 0 while the
    replacement is still in the loop. Its next collective fails; the job stops with the
    line that says the ranks ran different numbers of steps, at once: not after a 60 s
    rendezvous timeout, and not with "is a spare available?"."""
    job = run_job(tmp_path / "run", nnodes=2, spares=1,
                  script="tests/user_scripts/counted_range.py", script_args=(), timeout_s=150,
                  overrides=["recovery.fault=1:6:backward:sigkill", "replication.every_n_steps=2",
                             *FAST])
    assert not job.timed_out, job.output()
    fatal = job.events("job_failed")
    assert fatal, job.output()
    reason = fatal[0]["reason"]
    assert "finished training" in reason and "cl.steps(n)" in reason, reason
    assert "spare" not in reason, reason
    finished = min(e["ts"] for e in job.events("worker_exit") if e["exitcode"] == 0)
    assert fatal[0]["ts"] - finished < 10, (fatal[0]["ts"] - finished, reason)


def test_ranks_that_end_an_epoch_at_different_steps_stop_the_job(tmp_path):
    """Two epochs of a loop's own ``range(8)``: after the kill the survivors end epoch 0
    at an earlier step than the replacement, and go on into epoch 1 in step with it
    (their collectives match). The job stops when the replacement ends epoch 0, with the
    line naming the epoch and both steps."""
    job = run_job(tmp_path / "run", nnodes=2, spares=1,
                  script="tests/user_scripts/counted_range.py", script_args=("epochs",),
                  timeout_s=150, overrides=["recovery.fault=1:5:backward:sigkill", *FAST])
    assert not job.timed_out, job.output()
    fatal = job.events("job_failed")
    assert fatal, job.output()
    reason = fatal[0]["reason"]
    assert "ended epoch 0 at step" in reason and "cl.steps(n)" in reason, reason
