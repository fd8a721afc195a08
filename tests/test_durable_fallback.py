"""The durable tier as the last resort, under the real launcher with real processes.

* Every in-memory copy of a rank's state lost (``replication.factor=1`` and that rank
  SIGKILLed): instead of stopping, every rank restores the newest durable checkpoint,
  says why, and the run ends bit-identical to a failure-free one.
* A new job on a path that holds checkpoints resumes from the newest one that every
  rank can verify; corrupted newer ones are skipped, and the run says so.
* With no checkpoint to fall back to, the job still stops with both reasons.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from recovery.generation.protocol import read_events
from replication.durable import list_checkpoints
from tests.recovery_harness import (
    assert_failed_cleanly,
    assert_same_final,
    assert_succeeded,
    run_job,
    stop_reason,
)

pytestmark = pytest.mark.timeout(300)

FAULT_STEP = 21
STEPS = 120
#: Long enough that the writer's first save (its helper process imports torch first,
#: seconds on a busy 2-core machine) lands well before training ends.
ARGS = ("--steps", str(STEPS), "--dim", "32", "--layers", "1", "--batch", "4",
        "--seq-len", "16", "--step-sleep", "0.05")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = run_job(tmp_path_factory.mktemp("reference"), script_args=ARGS)
    assert_succeeded(job)
    return job


def _persist(path: Path, every: int = 2, keep: int = 3) -> list[str]:
    return [f"persistence.path={path}", f"persistence.every_n_steps={every}",
            f"persistence.keep_last={keep}"]


def _kill_rank1_once_a_checkpoint_exists(ckpt: Path):
    """SIGKILL rank 1 as soon as the durable tier holds a complete checkpoint."""

    def action(run_dir: Path) -> None:
        deadline = time.monotonic() + 150
        while not list_checkpoints(str(ckpt)):
            assert time.monotonic() < deadline, "no durable checkpoint appeared"
            time.sleep(0.05)
        starts = [e for e in read_events(run_dir / "events.jsonl")
                  if e["event"] == "worker_start" and e["rank"] == 1]
        os.kill(starts[-1]["pid"], signal.SIGKILL)

    return action


def test_every_copy_lost_falls_back_to_durable(tmp_path, reference):
    """replication.factor=1, and rank 1 SIGKILLed once a checkpoint exists: its state has
    no other in-memory copy, so every rank restores the newest durable checkpoint."""
    ckpt = tmp_path / "ckpt"
    job = run_job(tmp_path / "run", script_args=ARGS, timeout_s=240,
                  overrides=["replication.factor=1", *_persist(ckpt)],
                  during=_kill_rank1_once_a_checkpoint_exists(ckpt))
    assert_succeeded(job)
    assert_same_final(reference, job)

    fallbacks = job.events("durable_fallback")
    assert sorted(e["rank"] for e in fallbacks) == [0, 1], fallbacks
    steps = {e["step"] for e in fallbacks}
    assert len(steps) == 1, f"ranks restored different steps: {fallbacks}"
    step = steps.pop()
    assert 2 <= step < STEPS and step % 2 == 0, step
    assert all("no surviving copy" in e["reason"] for e in fallbacks), fallbacks
    assert all(e["steps_lost"] == e["committed_before"] - step for e in fallbacks)
    recs = [e for e in job.events("recovery") if e["target_step"] == step]
    assert sorted(e["rank"] for e in recs) == [0, 1], job.events("recovery")
    assert "falling back to durable storage" in job.output()
    assert not job.events("fatal")


def test_new_job_resumes_from_newest_verified_checkpoint(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    first = run_job(tmp_path / "first", script_args=ARGS, timeout_s=120,
                    overrides=_persist(ckpt, every=30, keep=3))
    assert_succeeded(first)
    steps = [c.step for c in list_checkpoints(str(ckpt))]
    # keep_last=3, and the final step is always persisted (a busy writer may skip others)
    assert len(steps) == 3 and steps[-1] == STEPS, steps
    older, middle, newest = steps
    _corrupt_one_file(ckpt / f"step_{newest}" / "rank_1")
    _corrupt_one_file(ckpt / f"step_{middle}" / "rank_0")

    second = run_job(tmp_path / "second", script_args=ARGS, timeout_s=120,
                     overrides=_persist(ckpt, every=30, keep=3))
    assert_succeeded(second)
    assert_same_final(reference, second)
    resumed = second.events("durable_resume")
    assert sorted(e["rank"] for e in resumed) == [0, 1], resumed
    assert {e["step"] for e in resumed} == {older}
    skipped = resumed[0]["skipped"]
    assert [s["step"] for s in skipped] == [newest, middle], skipped
    assert "rank 1" in skipped[0]["reason"] and "rank 0" in skipped[1]["reason"], skipped
    out = second.output()
    assert f"every rank restored step {older}" in out and f"skipped step {newest}" in out, out
    # the second job trained only the steps after the one it resumed from
    trained = sorted({e["step"] for e in second.events("step")})
    assert trained == list(range(older + 1, STEPS + 1)), trained


def test_resume_never_starts_fresh(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    first = run_job(tmp_path / "first", script_args=ARGS, timeout_s=120,
                    overrides=_persist(ckpt, every=8))
    assert_succeeded(first)
    second = run_job(tmp_path / "second", script_args=ARGS, timeout_s=120,
                     overrides=[*_persist(ckpt, every=8), "persistence.resume=never"])
    assert_succeeded(second)
    assert_same_final(reference, second)
    assert not second.events("durable_resume")
    assert min(e["step"] for e in second.events("step")) == 1


def test_every_copy_lost_and_no_checkpoint_stops_with_both_reasons(tmp_path):
    job = run_job(tmp_path / "run", script_args=ARGS, timeout_s=120, overrides=[
        "replication.factor=1", f"recovery.fault=1:{FAULT_STEP}:snapshot",
        f"persistence.path={tmp_path / 'empty'}", "persistence.every_n_steps=1000"])
    assert_failed_cleanly(job)
    reason = stop_reason(job)
    assert "no surviving copy" in reason and "holds no complete checkpoint" in reason, (
        reason or job.output())


def _corrupt_one_file(rank_dir: Path) -> None:
    """Flip a byte in the middle of the largest data file of one rank's checkpoint."""
    files = sorted((p for p in rank_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    victim = files[-1]
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
