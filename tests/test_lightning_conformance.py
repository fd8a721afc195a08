"""Lightning conformance: after a recovery, everything a Lightning user observes equals
the failure-free run, not only the weights.

The job (``tests/lightning_scripts/conformance.py``, 2 nodes x 2 workers) uses validation
every 4 batches, ``self.log`` with mean and sum reductions on step and epoch,
torchmetrics objects, ``EarlyStopping``, ``ModelCheckpoint(monitor="val_loss",
save_top_k=2, save_last=True)``, a ``CSVLogger``, gradient accumulation, a per-step
scheduler and a ``ReduceLROnPlateau``. A worker is SIGKILLed on different rank
positions, in training and in validation; the assertion is the whole observable
outcome:

- weights, optimizer state, step, data order (``assert_same_final``);
- every ``callback_metrics`` value callbacks saw after each validation and epoch, the
  final ``callback_metrics``, EarlyStopping's and ModelCheckpoint's states, the LR;
- a third-party-style callback's plain attributes (no ``state_dict``): its batch count,
  loss history and per-epoch sums;
- every row of the CSV logger's ``metrics.csv``, in order, in the same ``version_0``
  directory (no rows twice, none missing, no second version), and every row a logger
  without a local directory (W&B-like) was sent;
- the checkpoints written (names, which carry step and ``val_loss``).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
pytest.importorskip("torchmetrics")

from tests.helpers.durable_history import unjustified_skips
from tests.recovery_harness import assert_same_final, assert_succeeded, run_job

pytestmark = pytest.mark.timeout(400)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "tests/lightning_scripts/conformance.py"
FAST = ("recovery.heartbeat_timeout_s=10", "recovery.heartbeat_interval_s=0.5")
OBSERVED = ("seen", "callback_metrics", "early_stopping", "model_checkpoint", "lr", "tally")
STEPS = 18  # 3 epochs x 12 batches per rank / accumulate 2


def _rows(job) -> list[dict[str, str]]:
    path = job.run_dir / "csv" / "version_0" / "metrics.csv"
    assert path.is_file(), f"no {path}; logs: {sorted(os.listdir(job.run_dir / 'logs'))}"
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _remote_rows(job) -> list[dict]:
    """What the logger without a local directory sent (it cannot read it back)."""
    path = job.run_dir / "remote.jsonl"
    assert path.is_file(), f"no {path}"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _checkpoints(job) -> list[str]:
    return sorted(os.listdir(job.run_dir / "ckpts"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = run_job(tmp_path_factory.mktemp("reference"), nnodes=2, nproc=2, script=SCRIPT,
                  script_args=(), timeout_s=300, overrides=FAST)
    assert_succeeded(job)
    assert not job.events("recovery"), "the reference run recovered from something"
    finals = job.finals()
    assert {f["step"] for f in finals.values()} == {STEPS}
    return job


def assert_same_observed(reference, job) -> None:
    assert_same_final(reference, job)
    ref, got = reference.finals(), job.finals()
    for r in sorted(ref):
        for key in OBSERVED:
            assert got[r][key] == ref[r][key], (
                f"rank {r}: {key} differs from the failure-free run:\n"
                f"{json.dumps(got[r][key])}\n!=\n{json.dumps(ref[r][key])}")
    assert sorted(os.listdir(job.run_dir / "csv")) == ["version_0"], (
        "the logger split into versions", sorted(os.listdir(job.run_dir / "csv")))
    ref_rows, rows = _rows(reference), _rows(job)
    steps = [r["step"] for r in rows]
    assert rows == ref_rows, (
        f"logged rows differ: {len(rows)} rows (steps {steps}) against {len(ref_rows)} "
        f"(steps {[r['step'] for r in ref_rows]})")
    remote, ref_remote = _remote_rows(job), _remote_rows(reference)
    assert remote == ref_remote, (
        f"the remote logger got {len(remote)} rows (steps {[r['step'] for r in remote]}) "
        f"against {len(ref_remote)}")
    assert _checkpoints(job) == _checkpoints(reference)


def test_reference_is_observable(reference):
    """The reference itself exercises what the comparison relies on."""
    final = reference.finals()[0]
    wheres = [h["where"] for h in final["seen"]]
    assert wheres.count("validation") == 9 and wheres.count("train_epoch") == 3, wheres
    assert {"train_loss_epoch", "train_acc", "train_seen", "val_loss", "val_acc",
            "val_seen"} <= set(final["callback_metrics"])
    assert final["callback_metrics"]["val_seen"] == 48.0  # sum over 3 batches x 4 ranks x 4
    assert final["callback_metrics"]["train_seen"] == 48.0  # this rank's samples per epoch
    # 192 samples / 4 ranks / batch 4 = 12 batches an epoch, 3 epochs
    assert final["tally"]["batches"] == 36 and len(final["tally"]["losses"]) == 36
    assert sorted(final["tally"]["per_epoch"]) == ["0", "1", "2"]
    rows = _rows(reference)
    assert len({r["step"] for r in rows if r.get("train_loss_step")}) == STEPS
    names = _checkpoints(reference)
    assert "last.ckpt" in names and len(names) == 3, names


@pytest.mark.parametrize("fault,spares", [
    ("0:7:backward:sigkill", 1),   # rank 0, mid-epoch: a replacement rank 0 logs on
    ("3:13:optimizer:sigkill", 0),  # the other node, first steps of the last epoch
])
def test_kill_in_training(tmp_path, reference, fault, spares):
    job = run_job(tmp_path / "run", nnodes=2, nproc=2, spares=spares, script=SCRIPT,
                  script_args=(), timeout_s=300, overrides=(*FAST, f"recovery.fault={fault}"))
    assert_succeeded(job)
    assert len(job.events("fault_injected")) == 1, job.output()
    assert job.events("recovery"), "nothing recovered"
    assert_same_observed(reference, job)


def test_a_kill_before_a_snapshot_commits_goes_on_from_it_observably_the_same(
        tmp_path, reference):
    """Snapshots every 3 steps; rank 0 (the loggers' rank) dies in step 9's round,
    after sending its replicas and before the commit. The job goes on from step 9, not
    6 (ADR 0039, second addendum): the survivors restore their own snapshot of it, and
    rank 0's replacement takes the model and optimizer from a survivor's and everything
    else from its mark: loops, callbacks, held logger rows, RNG, and its own batch norm
    statistics (no validation ran after step 9, whose forward would have made every
    rank's the same: DDP broadcasts rank 0's buffers). Everything observed is the
    failure-free run's."""
    job = run_job(tmp_path / "run", nnodes=2, nproc=2, spares=1, script=SCRIPT,
                  script_args=(), timeout_s=300,
                  overrides=(*FAST, "recovery.fault=0:9:replication:sigkill",
                             "replication.every_n_steps=3"))
    assert_succeeded(job)
    [fault] = job.events("fault_injected")
    assert fault["step"] == 9, fault
    recs = job.events("recovery")
    survivors = [e for e in recs if not e["newcomer"]]
    assert all(e["live_step"] == fault["step"] for e in survivors), survivors
    if all(e["marks_held"].get("0") != fault["step"] for e in survivors):
        print("the kill came before rank 0's mark left: the snapshot path ran")
    else:
        assert {(e["target_step"], e["live"]) for e in recs} == {(fault["step"], True)}, recs
    assert_same_observed(reference, job)


def test_a_remote_logger_gets_each_row_once_when_rank_0_is_replaced(tmp_path, reference):
    """No logger with a local directory (W&B-like only): the replacement rank 0 learns
    from the job store which rows its predecessor released, and sends none twice.

    Rank 0 dies in step 7's replication round: at that step's boundary it had already
    released the rows of step 6 (committed), and step 7 never commits, so the recovery
    goes back to step 6, whose snapshot still carries those rows as held."""
    job = run_job(tmp_path / "run", nnodes=2, nproc=2, spares=1, script=SCRIPT,
                  script_args=("--remote-only",), timeout_s=300,
                  overrides=(*FAST, "recovery.fault=0:7:replication:sigkill"))
    assert_succeeded(job)
    assert [e for e in job.events("recovery") if e["newcomer"] and e["rank"] == 0]
    remote, ref_remote = _remote_rows(job), _remote_rows(reference)
    assert remote == ref_remote, (
        f"the remote logger got {len(remote)} rows (steps {[r['step'] for r in remote]}) "
        f"against {len(ref_remote)} (steps {[r['step'] for r in ref_remote]})")


def test_kill_in_validation(tmp_path, reference):
    """Rank 2 dies in the validation after step 4: the aborted validation's
    accumulators must not leak into the replayed one."""
    job = run_job(tmp_path / "run", nnodes=2, nproc=2, spares=1, script=SCRIPT,
                  script_args=("--kill-in-validation", "2:4"), timeout_s=300,
                  overrides=FAST)
    assert_succeeded(job)
    assert (job.run_dir / "killed-in-validation").exists(), job.output()
    assert_same_observed(reference, job)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def test_checkpoints_open_in_plain_lightning(reference, tmp_path):
    """A ModelCheckpoint written under the strategy: retention keeps one step in
    last.ckpt; `ckpt list`/`latest` find the roots one level down; the export loads in
    plain Lightning (load_from_checkpoint, fit(ckpt_path=...)); the directory itself loads
    with CheckpointlessCheckpointIO and no strategy."""
    ckpts = reference.run_dir / "ckpts"
    last = ckpts / "last.ckpt"
    assert sorted(p.name for p in last.iterdir() if p.name.startswith("step_")) == ["step_4"]

    listed = _cli("ckpt", "list", str(ckpts), "--json")
    assert listed.returncode == 0, listed.stderr
    found = json.loads(listed.stdout)["checkpoints"]
    assert {c["url"].rstrip("/").split("/")[-2] for c in found} == set(_checkpoints(reference))
    assert not any(c["contents_verified"] for c in found)
    table = _cli("ckpt", "list", str(ckpts))
    assert "complete" in table.stdout and "not re-hashed" in table.stdout, table.stdout

    latest = _cli("ckpt", "latest", str(ckpts))
    assert latest.returncode == 0, latest.stderr
    assert latest.stdout.strip().startswith(str(ckpts)), latest.stdout

    exported = tmp_path / "model.ckpt"
    done = _cli("ckpt", "export", "--lightning", str(last), str(exported))
    assert done.returncode == 0, done.stderr
    assert f"wrote {exported}" in done.stdout, done.stdout

    out = tmp_path / "plain.json"
    run = subprocess.run([sys.executable, "-m", "tests.lightning_scripts.plain_load",
                          str(exported), str(last), str(out)], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(out.read_text())
    assert seen["loaded_step"] == 4 and seen["weights_match"], seen
    assert seen["hparams"]["kill_in_validation"] == "", seen
    assert seen["fit_exported_step"] > 4 and seen["fit_durable_step"] > 4, seen


def test_ckpt_cli_says_what_is_wrong(tmp_path):
    missing = _cli("ckpt", "latest", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr, missing.stderr
    empty = _cli("ckpt", "latest", str(tmp_path))
    assert empty.returncode == 2 and "no complete checkpoint" in empty.stderr, empty.stderr
    bad = _cli("ckpt", "export", "--lightning", str(tmp_path), str(tmp_path / "x.ckpt"))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_persistence_cadence_is_honoured_with_validation(tmp_path):
    """persistence.every_n_steps=2 with validation after every second step: a save at
    every due step on every rank; one due at an epoch's end is made a step later, which one
    warning names.

    Before, the snapshot right after validation was skipped, so nothing was persisted
    during training. A save may still be *skipped by the writer* when the previous one
    is still being written (that is the writer's back-pressure, ADR 0005: it happened
    once here with four workers and the rest of the suite on two cores); every due step
    must reach the writer, and every skip must be justified by the run's own records
    (:mod:`tests.helpers.durable_history`): the previous save of that rank still being
    written for as long as the skip says, or, under load, a snapshot round that
    committed only after the next due one had ended (superseded, the same back-pressure
    one tier earlier). It used to bound the skips to a quarter of the rows, which a busy
    disk broke (10 of 36 under the suite's load)."""
    persist = tmp_path / "persist"
    job = run_job(tmp_path / "run", nnodes=2, nproc=2, script=SCRIPT, script_args=(),
                  timeout_s=300, overrides=(*FAST, f"persistence.path={persist}",
                                            "persistence.every_n_steps=2"))
    assert_succeeded(job)
    with open(persist / "checkpoint_history.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert not [r for r in rows if r["status"] not in ("ok", "skipped")], rows
    # Each skip is justified by this run's own records, not bounded in number (a busy
    # disk skips more: docs/testing.md, "Under load"); most saves still land on every
    # rank: each saved a due step before the last.
    assert not unjustified_skips(rows), unjustified_skips(rows)
    for rank in ("0", "1", "2", "3"):
        landed = {int(r["step"]) for r in rows if r["rank"] == rank and r["status"] == "ok"}
        assert landed - {STEPS}, (rank, rows)
    saved = {}
    for r in rows:
        saved.setdefault(int(r["step"]), set()).add(int(r["rank"]))
    # Epochs end at 6 and 12: the saves due there are made one step later.
    due = [s + 1 if s % 6 == 0 and s != STEPS else s for s in range(2, STEPS + 1, 2)]
    assert sorted(saved) == due and all(v == {0, 1, 2, 3} for v in saved.values()), saved
    assert job.output(200000).count("ends an epoch") == 1, job.output()
