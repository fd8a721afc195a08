"""``persistence.every_n_steps: auto`` in real jobs under ``checkpointless run`` (2 ranks,
gloo on CPU, the durable writer's helper processes writing to a local directory).

* Job A (snapshots every 8 steps, durable saves on auto): every rank logs the same
  ``auto_interval`` events for the persistence tier, a multiple of the snapshot
  interval; after the first choice every rank handles exactly the steps the interval
  in force makes due, and the final one; the checkpoints listed are those every rank
  wrote, and each verifies; the newest loads into fresh objects with exactly the state
  the run ended with.
* Job B resumes A's run with both tiers on auto: it restores A's newest checkpoint (which
  holds no snapshot interval: A's was fixed), keeps the save interval a multiple of the
  snapshot interval through both tiers' choices, and ends with a verified checkpoint of
  its final state.
* Rank 1 SIGKILLed after the first choice: its replacement receives the save interval
  with its state, and both ranks go on saving the same steps.
* Bad input for the new keys stops ``checkpointless run`` with one line naming the key.

Steps are padded (``--step-sleep``) so that a save (100-200 ms on an idle host) fits
well inside the shortest interval the policy can take (8 steps). On a loaded host a save
can still outlast it (a busy disk holds the fsync), and the writer then skips the next
due step on that rank, as documented. So "handled" means saved, or skipped because this
rank's previous save was still being written for as long as the skip says, checked
against that save's own measured duration (``_saved``): the reference is the run's own
saves, never an absolute number of seconds, and any other skip or failure fails.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.gpt import CharData, TinyGPT, lr_lambda, make_corpus, state_digest
from replication.durable import latest_checkpoint, list_checkpoints, load, read_history, verify
from replication.training_state.state import TrainingState
from tests.helpers.durable_history import unjustified_skips
from tests.recovery_harness import (
    REPO,
    assert_recovered,
    assert_succeeded,
    clean_env,
    recovery_events,
    run_job,
)

pytestmark = pytest.mark.timeout(240)

STEPS_A, STEPS_B = 192, 320
PROBE = 16  # SavePolicy.probe_every: the save interval until the first choice
ARGS = ("--dim", "32", "--layers", "1", "--step-sleep", "0.04")


def _overrides(ckpt: Path, *extra: str) -> tuple[str, ...]:
    return (f"persistence.path={ckpt}", "persistence.every_n_steps=auto",
            "persistence.max_overhead=0.5", "persistence.keep_last=100", *extra)


@pytest.fixture(scope="module")
def job_a(tmp_path_factory):
    root = tmp_path_factory.mktemp("persist_auto")
    ckpt = root / "ckpt"
    job = run_job(root / "run_a", overrides=_overrides(ckpt, "replication.every_n_steps=8"),
                  script_args=("--steps", str(STEPS_A), *ARGS), timeout_s=150)
    assert_succeeded(job)
    return job, ckpt


def _tier(job: Any, tier: str) -> dict[int, int]:
    """step -> interval, for the ``auto_interval`` events of ``tier``, checked to be the
    same on every rank (the agreement)."""
    by_step: dict[int, dict[int, int]] = {}
    for e in job.events("auto_interval"):
        if e["tier"] == tier:
            by_step.setdefault(e["step"], {})[e["rank"]] = e["every_n_steps"]
    for step, per_rank in by_step.items():
        assert set(per_rank) == {0, 1} and len(set(per_rank.values())) == 1, (step, per_rank)
    return {step: per_rank[0] for step, per_rank in sorted(by_step.items())}


def _in_force(changes: dict[int, int], step: int, first: int) -> int:
    """The interval in force when ``step``'s end is handled (changes made at earlier
    steps' agreements; ``first`` before any)."""
    earlier = [n for s, n in changes.items() if s < step]
    return earlier[-1] if earlier else first


def _saved(ckpt: Path, after: int, due: set[int] | None) -> dict[int, list[int]]:
    """rank -> steps after ``after`` it saved ("ok" rows of the history), checked against
    ``due`` and against the writer's own measurements.

    Each due step is saved by a rank, or skipped by it because its save of an earlier
    step was still being written (the writer's documented rule: a store that cannot
    keep up never stalls training nor grows memory), or because a newer due step
    superseded it. Such a skip must name a step the same rank saved, whose measured
    duration covers the time the skip reports, or the newer step the same rank handed
    to the writer (:mod:`tests.helpers.durable_history`): the reference is this run's
    own saves, not a number of seconds. Any other status (a
    failure, an abort, a skip for another reason) or a step saved that was not due
    fails, and the message names each row's status and why. At least one due step
    before the final one must be saved by every rank, so a run that skipped everything
    cannot pass; the final step is always saved (the writer is flushed for it).
    ``due=None``: the due steps are those either rank handled, the same on both."""
    rows = [r for r in read_history(str(ckpt)) if int(r["step"]) > after]
    ok = {(int(r["rank"]), int(r["step"])): float(r["duration_s"] or 0.0)
          for r in rows if r["status"] == "ok"}
    unjustified = unjustified_skips(rows)
    for r in rows:
        if r["status"] != "ok" and due is not None and int(r["step"]) not in due:
            unjustified.append((r["step"], r["rank"], "skipped, not due", r["detail"]))
    assert not unjustified, unjustified
    saved = {rank: sorted(s for (rk, s) in ok if rk == rank) for rank in (0, 1)}
    skipped = {rank: {int(r["step"]) for r in rows if int(r["rank"]) == rank
                      and r["status"] != "ok"} for rank in (0, 1)}
    if due is None:
        due = set(saved[0]) | skipped[0]
    for rank in (0, 1):
        assert set(saved[rank]) | skipped[rank] == due, (rank, saved, skipped, sorted(due))
    final = max(due)
    assert final in saved[0] and final in saved[1], saved
    assert set(saved[0]) & set(saved[1]) - {final}, (saved, skipped)
    return saved


def _assert_loads_exactly(ckpt: Path, final: dict[str, Any], steps: int) -> None:
    """The newest checkpoint, loaded into fresh objects, is the state the run ended with."""
    data = CharData(make_corpus(), 32, 8, rank=0, world=2, seed=0)
    torch.manual_seed(0)
    model = TinyGPT(data.vocab_size, 32, 1, seq_len=32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(10, steps))
    state = TrainingState()
    for name, obj in (("model", model), ("optimizer", opt), ("scheduler", sched),
                      ("loader", data)):
        state.register(name, obj)
    newest = latest_checkpoint(str(ckpt))
    assert newest is not None and newest.step == steps  # the final step is always saved
    load(newest, state, rank=0, world_size=2)
    assert state_digest(model, opt) == final["digest"]
    assert data.order_hash == final["data_order"] and data.position == steps


def test_every_rank_persists_the_agreed_steps_and_they_resume_exactly(job_a):
    job, ckpt = job_a
    changes = _tier(job, "persistence")
    assert changes, f"no persistence interval was chosen\n{job.output()}"
    assert not _tier(job, "replication")  # a fixed snapshot interval stays fixed
    assert all(n % 8 == 0 for n in changes.values()), changes  # on committed snapshots
    event = next(e for e in job.events("auto_interval") if e["rank"] == 0)
    assert event["reasons"] and event["save_s"] > 0 and 0 <= event["overhead"] <= 0.5
    assert "checkpointless: durable save interval at step" in job.output(100000)

    first = min(changes)
    # A committed step s is handed to the writer at the next snapshot (s + 8), with the
    # interval in force then; the final step is always saved.
    due = {s for s in range(first, STEPS_A, 8)
           if s % _in_force(changes, s + 8, PROBE) == 0} | {STEPS_A}
    saved = _saved(ckpt, first - 1, due)
    complete = sorted(set(saved[0]) & set(saved[1]))

    ckpts = [c for c in list_checkpoints(str(ckpt)) if c.step >= first]
    assert [c.step for c in ckpts] == complete  # listed: every rank wrote each one
    assert all(verify(c).ok for c in ckpts)
    _assert_loads_exactly(ckpt, job.finals()[0], STEPS_A)


def test_a_resumed_job_with_both_tiers_on_auto_keeps_saves_on_snapshots(job_a, tmp_path):
    job_a_, ckpt = job_a
    restored = list(_tier(job_a_, "persistence").values() or [PROBE])[-1]  # A's last
    # Steps padded twice as much as A's: B saves every 8 steps from its first step (A's
    # interval, restored), and on CI's loaded host one save once outlasted 8 steps of
    # A's padding, so the writer skipped the next one on one rank.
    job = run_job(tmp_path / "run_b", overrides=_overrides(
        ckpt, "replication.every_n_steps=auto"),
        script_args=("--steps", str(STEPS_B), *ARGS[:-1], "0.08"), timeout_s=150)
    assert_succeeded(job)
    resumed = job.events("durable_resume")
    assert sorted((e["rank"], e["step"]) for e in resumed) == [(0, STEPS_A), (1, STEPS_A)]

    snaps, saves = _tier(job, "replication"), _tier(job, "persistence")
    # A's checkpoint held no snapshot interval: B starts at the probe's 8. The save
    # interval restored from it (A's last, a multiple of 8) stays a multiple of the
    # snapshot interval after every agreement.
    for step, n in saves.items():
        assert n % _in_force(snaps, step + 1, 8) == 0, (step, snaps, saves)
    for step, n in snaps.items():
        assert _in_force(saves, step + 1, restored) % n == 0, (step, snaps, saves)

    saved = _saved(ckpt, STEPS_A, None)
    assert saved[0][-1] == saved[1][-1] == STEPS_B, saved
    # Each on a committed snapshot, at the first one at or after a multiple of a save
    # interval in force (a multiple with no snapshot of its own, after the snapshot
    # interval changed, is saved at the next snapshot: recovery.schedules.save_schedule).
    gap = max([8, *snaps.values()])
    for s in sorted(set(saved[0]) | set(saved[1]))[:-1]:
        assert any(s - s // n * n < gap for n in
                   {_in_force(saves, y, restored) for y in range(s + 1, s + 66)}), s
    newest = latest_checkpoint(str(ckpt))
    assert newest is not None and verify(newest).ok
    _assert_loads_exactly(ckpt, job.finals()[0], STEPS_B)


def test_a_replacement_persists_the_same_steps_as_the_survivors(tmp_path):
    """Rank 1 SIGKILLed after the first choice: its replacement receives the save
    interval with its state (not the probe's), so both ranks go on saving the same
    steps, and the checkpoints after the recovery are complete."""
    ckpt = tmp_path / "ckpt"
    # The snapshot path: with live rollback (ADR 0039) the target is the step before the
    # kill and the save interval's first choice came after it; not yet examined, so
    # pinned off here. The kill comes after two agreements (steps 64 and 128): on CI's
    # loaded host the first once proposed the probe's interval again, so the first
    # change came at 128, after a kill at step 100. Steps padded as B's: on CI's loaded
    # host both ranks' rows for step 168 were once not "ok"; the likely cause is saves of
    # 160 outlasting 8 steps of A's padding, so each writer skipped 168 (the writer's
    # rule, not this test's subject). _saved's message now names the status and reason.
    job = run_job(tmp_path / "run", spares=1, overrides=_overrides(
        ckpt, "replication.every_n_steps=8", "recovery.fault=1:150:backward",
        "recovery.live_rollback=false"),
        script_args=("--steps", str(STEPS_A), *ARGS[:-1], "0.08"), timeout_s=150)
    assert_succeeded(job)
    assert_recovered(job, every_n_steps=8)
    (target,) = {int(e["target_step"]) for e in recovery_events(job)}
    assert any(e["newcomer"] for e in recovery_events(job))
    changes = _tier(job, "persistence")
    assert changes and min(changes) < target, (changes, target)  # chosen before the fault
    # The new generation's replicator has no round yet: target + 8 is the first step it
    # commits, handed to the writers at target + 16.
    due = {s for s in range(target + 8, STEPS_A, 8)
           if s % _in_force(changes, s + 8, PROBE) == 0} | {STEPS_A}
    saved = _saved(ckpt, target, due)
    complete = sorted(set(saved[0]) & set(saved[1]))
    ckpts = [c for c in list_checkpoints(str(ckpt)) if c.step > target]
    assert [c.step for c in ckpts] == complete and all(verify(c).ok for c in ckpts)


@pytest.mark.parametrize(("override", "says"), [
    ("persistence.every_n_steps=sometimes",
     "checkpointless.persistence.every_n_steps: got 'sometimes'; expected an integer >= 0, "
     "or 'auto'"),
    ("persistence.max_overhead=0",
     "checkpointless.persistence.max_overhead: got '0'; expected a number in [0.0001, 1.0]"),
])
def test_bad_input_stops_the_run_with_one_line(tmp_path, override, says):
    cmd = [sys.executable, "-m", "launcher.cli", "run", "--standalone", "--nproc-per-node",
           "2", f"persistence.path={tmp_path}", "persistence.every_n_steps=auto", override,
           "examples/train_gpt.py"]
    proc = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("checkpointless: error:"), proc.stderr
    assert says in lines[0], lines[0]
    assert not list(tmp_path.iterdir())  # nothing ran: no checkpoint directory either

