"""The durable tier under failure: a writer SIGKILLed mid-save (real processes), a full
disk, a failing store, a slow store, and a writer closed in the middle of a save.

In every case training must go on (``submit`` returns at once), the previous checkpoint
must stay intact and loadable, and nothing half-written may ever be listed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from replication.durable import list_checkpoints, load, prune, read_history, scan
from replication.snapshots.snapshot import SnapshotEngine
from tests.helpers.training import assert_tree_equal
from tests.test_durable_support import (
    config,
    fast_writer,
    faulty,
    make_state,
    persist,
    snapshot,
    train,
)

REPO = Path(__file__).resolve().parent.parent

KILL_SCRIPT = r"""
import sys, time, torch
from replication.snapshots.snapshot import SnapshotEngine
from tests.test_durable_support import config, faulty, make_state, make_writer, persist
from tests.test_durable_support import snapshot, train

root, mode, ref = sys.argv[1], sys.argv[2], sys.argv[3]
fs = faulty()
state, objs = make_state()
engine = SnapshotEngine(state)
writer = make_writer(config(f"faultyfs://{root}"))
train(objs, 2)
assert persist(writer, engine, 1).status == "ok"
torch.save(objs["model"].state_dict(), ref)
train(objs, 2)
if mode == "data":
    fs.delay_per_mb_s = 30.0  # a slow store: the parent kills us mid-write
elif mode == "helper":  # the default writer: its helper process writes, slowly
    from replication.durable import DurableWriter
    writer.close()
    writer = DurableWriter(config(root), 0, 1, max_write_mbps=0.01)
else:
    fs.kill_on = mode  # die halfway through writing this file
writer.submit(*snapshot(engine, 2))
helper = writer._backend.proc.pid if writer._backend is not None else 0
print("WRITING", helper, flush=True)
time.sleep(120)
"""

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # no_dist saves



@pytest.fixture
def faulty_fs():
    fs = faulty()
    fs.reset()
    yield fs
    fs.reset()


@pytest.fixture
def closing(faulty_fs):
    """``closing(writer)`` returns ``writer`` and closes it when the test ends, passed or
    failed, after healing the store so that a save it is still retrying ends at once. A
    writer left running would keep opening files on the class-wide ``faultyfs`` during
    the next tests, taking failures injected for them."""
    writers = []
    yield lambda writer: writers.append(writer) or writer
    faulty_fs.reset()
    for writer in writers:
        writer.close()


def _wait_for(cond, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _check_after_kill(root: Path, ref: Path, partial: bool) -> None:
    assert [c.step for c in list_checkpoints(str(root))] == [1]
    steps = {c.step: c for c in scan(str(root))}
    if partial:  # a partial save is on disk, and not listed
        assert steps[2].status == "incomplete" and steps[2].nbytes > 0
    else:  # the helper removed what it had written before exiting
        assert 2 not in steps or steps[2].nbytes == 0
    state, objs = make_state(seed=42)
    assert load(str(root), state).step == 1
    assert_tree_equal(objs["model"].state_dict(), torch.load(ref, weights_only=True))
    prune(str(root), keep_last=1, incomplete_grace_s=0)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == ["step_1"]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split(")")[-1].split()[0] == "Z")


def test_sigkill_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    """Real training processes are SIGKILLed mid-save: one by the parent while its data
    file is half written (a slow store), one by itself halfway through the manifest (the
    last file of a save), one while its helper process writes (the helper must notice
    and exit, leaving nothing listed). All run at once to save wall time."""
    modes = {"data": "data", "manifest": "MANIFEST.json", "helper": "helper"}
    procs = {}
    for name, mode in modes.items():
        root = tmp_path / name
        root.mkdir()
        procs[name] = subprocess.Popen(
            [sys.executable, "-c", KILL_SCRIPT, str(root), mode, str(tmp_path / f"{name}.pt")],
            cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )
    helper_pid = 0
    try:
        for name, proc in procs.items():
            assert proc.stdout is not None and proc.stderr is not None
            line = proc.stdout.readline().split()
            assert line and line[0] == "WRITING", proc.stderr.read()
            if name == "manifest":
                continue
            data = tmp_path / name / "step_2" / "rank_0" / "__0_0.distcp"
            if name == "data":
                _wait_for(lambda d=data: d.exists() and d.stat().st_size > 0,
                          what="a partial data file")
            else:
                helper_pid = int(line[1])
                _wait_for(data.exists, timeout=60, what="the helper to start writing")
            proc.send_signal(signal.SIGKILL)
        for proc in procs.values():
            assert proc.wait(timeout=60) == -signal.SIGKILL
        assert helper_pid
        _wait_for(lambda: not _pid_alive(helper_pid), timeout=30, what="the helper to exit")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if helper_pid and _pid_alive(helper_pid):
            os.kill(helper_pid, signal.SIGKILL)
    manifest_dir = tmp_path / "manifest" / "step_2"
    assert any(p.name.startswith("MANIFEST.json.tmp") for p in manifest_dir.iterdir())
    for name in procs:
        _check_after_kill(tmp_path / name, tmp_path / f"{name}.pt", partial=name != "helper")


def _train_and_submit(writer, engine, objs, steps):
    """A training loop that offers every step to the writer, as the runtime would.
    Returns the tickets, and for each one whether its save was still unfinished when
    ``maybe_submit`` returned: a submit that waited for storage would only return with
    its save over (skipped ones are over at once, by design)."""
    tickets, unfinished = [], []
    prev = None
    for step in steps:
        train(objs)
        if prev is not None:  # the slot of step-1 may be captured into again soon
            assert prev.wait_released(10)
        meta, buf = snapshot(engine, step)
        ticket = writer.maybe_submit(meta, buf)
        if ticket is not None:
            unfinished.append(not ticket.done.done())
            tickets.append(ticket)
            prev = ticket
    return tickets, unfinished


def _files_outside(root: Path, keep: set[str]) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.relative_to(root).parts[0]
            .startswith("step_") and p.relative_to(root).parts[0] not in keep]


@pytest.mark.parametrize("fault", ["full", "failing"])
def test_full_or_failing_store_never_stops_training(tmp_path, faulty_fs, closing, fault, caplog):
    root = tmp_path / "ckpt"
    state, objs = make_state()
    engine = SnapshotEngine(state)
    writer = closing(fast_writer(config(f"faultyfs://{root}")))
    train(objs)
    assert persist(writer, engine, 1).status == "ok"
    want = {k: v.clone() for k, v in objs["model"].state_dict().items()}
    if fault == "full":
        faulty_fs.budget = 20_000  # less than one save: ENOSPC partway through
    else:
        faulty_fs.fail_always = True
    # The store does not answer at all until every step has been offered: training goes
    # on, and the save it took on was still unfinished when its submit returned (a
    # bound of 50 ms on each submit measured the host: 60-160 ms under load).
    faulty_fs.hold = threading.Event()
    tickets, unfinished = _train_and_submit(writer, engine, objs, range(2, 12))
    assert objs["loop"].step == 11  # training went on
    assert unfinished[0] and not any(t.done.done() for t in tickets[:1]), unfinished
    faulty_fs.hold.set()
    results = [t.result(30) for t in tickets]
    assert {r.status for r in results} <= {"failed", "skipped"}
    failed = [r for r in results if r.status == "failed"]
    assert failed and all(r.attempts == 3 for r in failed)
    assert ("No space left" if fault == "full" else "injected I/O error") in failed[0].error
    assert "DURABLE CHECKPOINT FAILED" in caplog.text
    assert [c.step for c in list_checkpoints(str(root))] == [1]
    assert _files_outside(root, {"step_1"}) == []  # partial files were removed
    fresh_state, fresh = make_state(seed=3)
    load(str(root), fresh_state)
    assert_tree_equal(dict(fresh["model"].state_dict()), want)
    # The store recovers: the next due step is persisted again.
    faulty_fs.reset()
    assert persist(writer, engine, 12).status == "ok"
    writer.close()
    assert [c.step for c in list_checkpoints(str(root))] == [1, 12]
    statuses = {r["status"] for r in read_history(str(root))}
    assert {"ok", "failed"} <= statuses


def test_flaky_store_is_retried_with_backoff(tmp_path, faulty_fs):
    state, objs = make_state()
    engine = SnapshotEngine(state)
    faulty_fs.fail_opens = 2
    faulty_fs.fail_under = f"{tmp_path}/step_1/"  # this save's opens only
    with fast_writer(config(f"faultyfs://{tmp_path}")) as writer:
        train(objs)
        result = persist(writer, engine, 1)
    assert result.status == "ok" and result.attempts == 3 and result.committed
    assert faulty_fs.fail_opens == 0  # both injected failures went to this save
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [1]


def test_slow_store_skips_steps_instead_of_queueing_them(tmp_path, faulty_fs, closing):
    state, objs = make_state()
    engine = SnapshotEngine(state)
    faulty_fs.delay_per_mb_s = 8.0  # about half a second per save of this state
    writer = closing(fast_writer(config(f"faultyfs://{tmp_path}")))
    tickets, unfinished = _train_and_submit(writer, engine, objs, range(1, 6))
    assert unfinished[0], unfinished  # the first save was under way when submit returned
    statuses = [t.result(30).status for t in tickets]
    assert statuses[0] == "ok" and "skipped" in statuses
    skipped = next(t.result() for t in tickets if t.result().status == "skipped")
    assert "cannot keep up" in skipped.error
    writer.close()
    rows = read_history(str(tmp_path))
    assert len(rows) == len(tickets) and "skipped" in {r["status"] for r in rows}


def test_close_aborts_a_save_that_does_not_finish(tmp_path, faulty_fs, closing):
    state, objs = make_state()
    engine = SnapshotEngine(state)
    writer = closing(fast_writer(config(f"faultyfs://{tmp_path}")))
    train(objs)
    assert persist(writer, engine, 1).status == "ok"
    faulty_fs.delay_per_mb_s = 200.0  # several seconds per save
    ticket = writer.submit(*snapshot(engine, 2))
    assert ticket.wait_released(10)
    t0 = time.monotonic()
    writer.close(timeout=0.3)
    assert time.monotonic() - t0 < 10
    assert ticket.result(10).status == "aborted"
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [1]
    assert _files_outside(tmp_path, {"step_1"}) == []
