"""The default writer: serialisation and I/O in a helper process per rank.

One writer, paced so that a save lasts about a second, goes through a normal save
(logs forwarded from the helper, staging in shared memory), a corrupted snapshot, the
helper's death mid-save (the save fails, its partial files are removed, the next save
restarts the helper) and a close() that aborts a save in progress.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from replication.durable import DurableWriter, list_checkpoints, load, scan
from replication.snapshots.snapshot import SnapshotEngine
from tests.test_durable_support import config, make_state, persist, snapshot, train

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # no_dist saves



def _wait_for(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_helper_process_saves_survives_its_death_and_aborts_on_close(tmp_path, caplog):
    caplog.set_level("INFO", logger="checkpointless.durable")
    state, objs = make_state()
    engine = SnapshotEngine(state)
    writer = DurableWriter(config(str(tmp_path)), 0, 1, max_write_mbps=0.05)
    assert writer.isolation == "process"
    first_helper = writer._backend.proc.pid
    assert first_helper != os.getpid()
    # 1. A normal save, submitted while the helper is still starting (importing torch):
    # the buffer comes back at once all the same; the helper writes, and logs through us.
    train(objs)
    ticket = writer.submit(*snapshot(engine, 1))
    assert ticket.wait_released(2) and not ticket.done.done()
    result = ticket.result(60)
    assert result.status == "ok" and result.committed, result
    assert "persisted step 1 (rank 0)" in caplog.text
    shm_path = Path("/dev/shm") / writer._shm.name.lstrip("/")
    assert shm_path.exists() and writer.staging_bytes > 0
    # A snapshot whose bytes do not match its digests is refused; the helper carries on.
    train(objs)
    meta, buf = snapshot(engine, 2)
    buf[100] ^= 1
    bad = writer.submit(meta, buf).result(30)
    assert bad.status == "failed" and "verification" in bad.error, bad
    assert not (tmp_path / "step_2").exists() or not any((tmp_path / "step_2").iterdir())
    assert writer._backend.proc.pid == first_helper
    # 2. The helper dies in the middle of a save.
    train(objs)
    ticket = writer.submit(*snapshot(engine, 3))
    data = tmp_path / "step_3" / "rank_0" / "__0_0.distcp"
    _wait_for(data.exists)
    os.kill(first_helper, signal.SIGKILL)
    failed = ticket.result(30)
    assert failed.status == "failed" and "helper process died" in failed.error
    assert not (tmp_path / "step_3" / "rank_0").exists()  # its partial files were removed
    # 3. The next save restarts the helper; close() aborts it midway.
    train(objs)
    ticket = writer.submit(*snapshot(engine, 4))
    _wait_for(lambda: (tmp_path / "step_4" / "rank_0" / "__0_0.distcp").exists())
    second_helper = writer._backend.proc.pid
    assert second_helper != first_helper
    writer.close(timeout=0.2)
    assert ticket.result(30).status == "aborted"
    assert writer._backend.proc.poll() is not None  # the helper is gone
    assert not shm_path.exists()  # and so is the shared staging buffer
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [1]
    assert all(c.nbytes == 0 for c in scan(str(tmp_path)) if c.step != 1)
    fresh_state, _ = make_state(seed=5)
    assert load(str(tmp_path), fresh_state).step == 1


def test_a_helper_that_cannot_start_falls_back_to_a_thread(tmp_path, monkeypatch, caplog):
    import sys

    broken = tmp_path / "broken-python"
    broken.write_text("#!/bin/sh\nsleep 0.3\nexit 3\n")  # a helper that dies while starting
    broken.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(broken))
    state, objs = make_state()
    engine = SnapshotEngine(state)
    train(objs)
    with DurableWriter(config(str(tmp_path)), 0, 1) as writer:
        first = persist(writer, engine, 1)
        assert first.status == "failed" and "helper process died" in first.error
        assert writer.isolation == "thread"
        assert "failed to start" in caplog.text
        assert persist(writer, engine, 2).status == "ok"
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [2]


def test_helper_leaves_quietly_when_its_training_process_is_gone(tmp_path):
    """A rank SIGKILLed while its helper still imports torch: the helper's "ready" meets
    a closed socket. It must exit 0 without a traceback on the job's console."""
    import os
    import socket
    import subprocess
    import sys
    from multiprocessing.connection import Connection

    from replication.durable.messages import Init

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parent, child = socket.socketpair()
    proc = subprocess.Popen(
        [sys.executable, "-m", "replication.durable.worker", str(child.fileno())],
        pass_fds=[child.fileno()], stderr=subprocess.PIPE, cwd=repo,
        env=dict(os.environ, PYTHONPATH=repo))
    child.close()
    conn = Connection(parent.detach())
    conn.send(Init(dict(path=str(tmp_path / "durable"), storage_options={}, rank=0,
                        world_size=1, run_id="gone", keep_last=2)))
    conn.close()  # the training process is gone before the helper is ready
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and b"Traceback" not in err, err.decode()[-2000:]
