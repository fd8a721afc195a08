"""Gradient accumulation under Lightning and FSDP2, killed in the middle of an
accumulation, must end bit-identical to a failure-free run.

With accumulation, one optimizer step spans several micro-batches, and a failure
between them leaves a survivor holding gradients of a step that never happened (in
``.grad`` under DDP, on the unsharded parameters under FSDP2 with the gradient sync
off). A recovery that kept them, or that resumed at the wrong micro-batch, would add
them into the replayed step: the weights would differ, and so would the logged rows.

Both jobs run on 2 nodes x 2 workers under ``checkpointless run`` (gloo on CPU, real
processes). Where each kill lands is not assumed: each script appends a line per
micro-batch event to ``trace_rank<r>.jsonl`` (outside the registered state, so a
rollback removes none), and the tests read the killed process's last line.

- **Lightning** (``tests/lightning_scripts/accumulate.py``,
  ``Trainer(strategy="checkpointless", accumulate_grad_batches=2)``): the strategy calls
  ``begin_step(global_step + 1)`` before every batch is fetched, so both batches of
  optimizer step S run as the runtime's step S (``global_step`` is S-1 during both).
  An ``optimizer`` fault fires in torch's step pre-hook, and Lightning runs the last
  batch's ``training_step`` and backward inside ``optimizer.step(closure)``: the fault
  fires after the first batch's backward and before the second batch's forward.
- **FSDP2** (``tests/user_scripts/fsdp2_accumulate.py``): ``examples/train_fsdp2.py``'s
  loop under ``cl.run`` with 2 micro-batches a step, ``set_requires_gradient_sync(False)``
  on the first and ``True`` on the last. A ``backward`` fault fires as the first
  micro-batch's backward starts (gradient sync off); ``--kill-between`` kills once that
  backward is done; a node loss in ``optimizer`` comes after both micro-batches.
"""

from __future__ import annotations

import csv
import json
import os
from typing import Any

import pytest

from tests.recovery_harness import JobResult, assert_same_final, assert_succeeded, run_job

pytestmark = pytest.mark.timeout(400)

LIGHTNING = "tests/lightning_scripts/accumulate.py"
FSDP2 = "tests/user_scripts/fsdp2_accumulate.py"
#: 192 samples / 4 ranks / batch 4 = 12 batches an epoch, 2 epochs, 2 batches a step
LIGHTNING_STEPS = 12
FSDP2_STEPS = 10
FSDP2_ARGS = ("--steps", str(FSDP2_STEPS))
#: Exits of a torch process take seconds on a loaded 2-core box; keep them under it.
#: A snapshot every step, as for FSDP2 below.
FAST = ("recovery.heartbeat_timeout_s=10", "recovery.heartbeat_interval_s=0.5",
        "replication.every_n_steps=1")
#: A snapshot every step: the recovery goes back to the step before the interrupted one,
#: so the data resumes mid-pass (at micro-batch 2(S-1)), not at the start.
FSDP2_SETTINGS = ("recovery.heartbeat_timeout_s=3", "recovery.heartbeat_interval_s=0.5",
                  "recovery.collective_timeout_s=30", "replication.every_n_steps=1")
#: Lightning's final_rank fields compared beyond assert_same_final's
LIGHTNING_OBSERVED = ("optimizer_steps", "ended_on", "adam_steps", "lr")


# --- reading what the jobs left -------------------------------------------------------
def _trace(job: JobResult, rank: int) -> list[dict[str, Any]]:
    path = job.run_dir / f"trace_rank{rank}.jsonl"
    assert path.is_file(), f"no {path}\n{job.output()}"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _killed_process(job: JobResult, rank: int) -> list[dict[str, Any]]:
    """The trace lines of ``rank``'s first process (the one the fault killed), and a
    check that another process took its place."""
    lines = _trace(job, rank)
    first = lines[0]["pid"]
    assert any(line["pid"] != first for line in lines), (
        f"rank {rank}: no process after {first} wrote a trace line; was it killed?")
    return [line for line in lines if line["pid"] == first]


def _rows(job: JobResult) -> list[dict[str, str]]:
    versions = sorted(os.listdir(job.run_dir / "csv"))
    assert versions == ["version_0"], f"the logger split into versions: {versions}"
    with open(job.run_dir / "csv" / "version_0" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def _fired(job: JobResult, step: int) -> dict[str, Any]:
    """The single fault event, at ``step``, and at least one recovery after it."""
    fired = job.events("fault_injected")
    assert len(fired) == 1, f"the fault fired {len(fired)} times: {fired}\n{job.output()}"
    assert fired[0]["step"] == step, fired
    _recovered_before(job, step)
    return fired[0]


def _recovered_before(job: JobResult, step: int) -> None:
    """A recovery happened, to a committed step in 1 .. ``step`` - 1: the
    data resumes mid-pass, at the first micro-batch of the step after the target (with
    a snapshot every step, the target is ``step - 1`` unless its round was late)."""
    recs = job.events("recovery")
    assert recs, f"nothing was recovered\n{job.output()}"
    targets = {e["target_step"] for e in recs}
    assert all(1 <= t < step for t in targets), f"recovery targets {targets}, fault at {step}"


def _same_losses(reference: JobResult, job: JobResult) -> None:
    ref, got = reference.finals(), job.finals()
    for rank in sorted(ref):
        assert len(ref[rank]["losses"]) == FSDP2_STEPS, "a step's loss is missing"
        diff = [i + 1 for i, (a, b) in enumerate(zip(got[rank]["losses"],
                                                     ref[rank]["losses"])) if a != b]
        assert got[rank]["losses"] == ref[rank]["losses"], (
            f"rank {rank}: step losses differ at steps {diff} (lengths "
            f"{len(got[rank]['losses'])} and {len(ref[rank]['losses'])})")


# --- Lightning ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lightning_reference(tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    pytest.importorskip("lightning")
    job = run_job(tmp_path_factory.mktemp("lightning_ref"), nnodes=2, nproc=2,
                  script=LIGHTNING, script_args=(), timeout_s=300, overrides=FAST)
    assert_succeeded(job)
    assert not job.events("recovery"), "the reference run recovered from something"
    finals = job.finals()
    assert sorted(finals) == [0, 1, 2, 3]
    for final in finals.values():  # 2 batches per optimizer step, as configured
        assert final["step"] == final["optimizer_steps"] == LIGHTNING_STEPS, final
        assert final["adam_steps"] == [float(LIGHTNING_STEPS)], final
        assert all(b % 2 == 1 for b in final["ended_on"]), final["ended_on"]
    assert len({r["step"] for r in _rows(job) if r.get("train_loss_step")}) == LIGHTNING_STEPS
    return job


@pytest.mark.parametrize("fault,spares", [
    ("1:4:optimizer:sigkill", 1),  # node 0, mid-epoch 0: a warm spare takes rank 1
    ("2:9:optimizer:sigkill", 0),  # node 1, mid-epoch 1: the agent restarts rank 2
])
def test_lightning_kill_between_accumulated_batches(
        tmp_path: Any, lightning_reference: JobResult, fault: str, spares: int) -> None:
    """A worker SIGKILLed between the two batches of optimizer step S: the run ends as
    the failure-free one did (weights, AdamW state, data order, global step, optimizer
    steps counted and the batch each ended on, LR, every CSV row).

    How we know the kill lands between the batches: with ``b = 2((S-1) mod 6)`` the
    step's first batch index in its epoch (6 steps an epoch), the killed process's trace
    ends with ``backward`` of batch ``b`` and then ``start`` of batch ``b+1``, both at
    ``global_step`` S-1, with no ``forward`` of ``b+1`` and no ``optimizer`` event of
    step S; the fault event names step S. (Where each survivor meets the failure is
    timing: typically in the second batch's DDP all-reduce, with the first batch's
    gradients in ``.grad``.)"""
    rank, step = (int(v) for v in fault.split(":")[:2])
    job = run_job(tmp_path / "run", nnodes=2, nproc=2, spares=spares, script=LIGHTNING,
                  script_args=(), timeout_s=300, overrides=(*FAST, f"recovery.fault={fault}"))
    assert_succeeded(job)
    _fired(job, step)

    killed = _killed_process(job, rank)
    first = 2 * ((step - 1) % (LIGHTNING_STEPS // 2))  # the step's first batch in its epoch
    last_two = [(e["event"], e["batch_idx"], e["global_step"]) for e in killed[-2:]]
    assert last_two == [("backward", first, step - 1), ("start", first + 1, step - 1)], (
        f"rank {rank}'s killed process did not die between the batches of step {step}: "
        f"its last events are {last_two}")
    assert not [e for e in killed if e["event"] == "optimizer" and e["global_step"] == step - 1]

    assert_same_final(lightning_reference, job)
    ref, got = lightning_reference.finals(), job.finals()
    for r in sorted(ref):
        for key in LIGHTNING_OBSERVED:
            assert got[r][key] == ref[r][key], (
                f"rank {r}: {key} differs from the failure-free run: "
                f"{got[r][key]!r} != {ref[r][key]!r}")
    rows, ref_rows = _rows(job), _rows(lightning_reference)
    assert rows == ref_rows, (
        f"logged rows differ: {len(rows)} rows (steps {[r['step'] for r in rows]}) against "
        f"{len(ref_rows)} (steps {[r['step'] for r in ref_rows]})")


# --- FSDP2 ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fsdp2_reference(tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    job = run_job(tmp_path_factory.mktemp("fsdp2_ref"), nnodes=2, nproc=2, script=FSDP2,
                  script_args=FSDP2_ARGS, overrides=FSDP2_SETTINGS, timeout_s=240)
    assert_succeeded(job)
    assert not job.events("recovery"), "the reference run recovered from something"
    finals = job.finals()
    assert sorted(finals) == [0, 1, 2, 3]
    assert {f["step"] for f in finals.values()} == {FSDP2_STEPS}
    assert {f["position"] for f in finals.values()} == {2 * FSDP2_STEPS}  # 2 micro-batches
    assert len({f["digest"] for f in finals.values()}) == 4  # four different shards
    return job


def _fsdp2_recovered(reference: JobResult, job: JobResult, step: int) -> None:
    _recovered_before(job, step)
    recs = job.events("recovery")
    survivors = [e for e in recs if not e["newcomer"]]
    # the reset that drops the unsharded copies' accumulated gradients ran on each
    assert survivors and all(e["fsdp_modules_reset"] == 1 for e in survivors), survivors
    assert_same_final(reference, job)
    _same_losses(reference, job)


def _never_finished(job: JobResult, gen: int, step: int, victims: tuple[int, ...]) -> None:
    """No survivor finished step ``step``'s last backward in generation ``gen``: each
    was inside the accumulation when the failure reached it."""
    for r in sorted(set(range(job.world_size)) - set(victims)):
        done = [e for e in _trace(job, r) if (e["gen"], e["step"], e["micro"], e["event"])
                == (gen, step, 1, "backward")]
        assert not done, f"rank {r} finished step {step}'s accumulation in gen {gen}: {done}"


def test_fsdp2_worker_kill_in_the_unsynced_micro_batch(
        tmp_path: Any, fsdp2_reference: JobResult) -> None:
    """Rank 1 is SIGKILLed in step 4's first backward (``set_requires_gradient_sync(False)``):
    the survivors hold that micro-batch's partial gradients on their unsharded
    parameters. The run ends bit-identical: shards, AdamW state, data order, every
    step's loss.

    How we know: the killed process's last trace line is ``forward`` of step 4, micro-batch
    0 (the ``backward`` fault fires from the root's backward pre-hook), so it died
    after the first forward and before any gradient sync or optimizer step."""
    job = run_job(tmp_path / "run", nnodes=2, nproc=2, spares=1, script=FSDP2,
                  script_args=FSDP2_ARGS, timeout_s=240,
                  overrides=(*FSDP2_SETTINGS, "recovery.fault=1:4:backward:sigkill"))
    assert_succeeded(job)
    _fired(job, 4)
    killed = _killed_process(job, 1)
    last = killed[-1]
    assert (last["step"], last["micro"], last["event"]) == (4, 0, "forward"), last
    _never_finished(job, last["gen"], 4, victims=(1,))
    _fsdp2_recovered(fsdp2_reference, job, 4)


def test_fsdp2_worker_killed_between_micro_batches(
        tmp_path: Any, fsdp2_reference: JobResult) -> None:
    """Rank 2 SIGKILLs itself once step 5's first micro-batch is done, before the second
    one's forward: the exact middle of an accumulation. No ``recovery.fault`` phase is
    there, so the script kills itself (once per job, a marker file), as the Lightning
    validation kills do. Bit-identical as above.

    How we know: the marker exists and the killed process's last trace line is
    ``backward`` of step 5, micro-batch 0."""
    job = run_job(tmp_path / "run", nnodes=2, nproc=2, spares=1, script=FSDP2,
                  script_args=(*FSDP2_ARGS, "--kill-between", "2:5"), timeout_s=240,
                  overrides=FSDP2_SETTINGS)
    assert_succeeded(job)
    assert (job.run_dir / "killed-between").exists(), job.output()
    assert not job.events("fault_injected"), "no recovery.fault was set"
    killed = _killed_process(job, 2)
    last = killed[-1]
    assert (last["step"], last["micro"], last["event"]) == (5, 0, "backward"), last
    _never_finished(job, last["gen"], 5, victims=(2,))
    _fsdp2_recovered(fsdp2_reference, job, 5)


def test_fsdp2_node_loss_after_the_accumulation(tmp_path: Any, fsdp2_reference: JobResult) -> None:
    """Node 1 (its agent, ranks 2 and 3) dies as rank 2 enters step 7's optimizer step,
    both micro-batches' backward done (the second reduce-scattered the sum); the spare
    node takes ranks 2 and 3, which receive their shards from node 0. Bit-identical.

    How we know: rank 2's killed process's last trace line is ``backward`` of step 7,
    micro-batch 1."""
    job = run_job(tmp_path / "run", nnodes=2, nproc=2, spare_nodes=1, script=FSDP2,
                  script_args=FSDP2_ARGS, timeout_s=240,
                  overrides=(*FSDP2_SETTINGS, "recovery.fault=2:7:optimizer:node"))
    assert job.returncodes[1] == -9, f"node 1's agent should be SIGKILLed: {job.returncodes}"
    assert_succeeded(job, except_nodes=(1,))
    _fired(job, 7)
    last = _killed_process(job, 2)[-1]
    assert (last["step"], last["micro"], last["event"]) == (7, 1, "backward"), last
    recs = job.events("recovery")
    newest = [e for e in recs if e["gen"] == max(r["gen"] for r in recs)]
    assert {e["rank"] for e in newest if e["newcomer"]} == {2, 3}, recs
    _fsdp2_recovered(fsdp2_reference, job, 7)
