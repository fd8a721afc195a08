"""No teardown waits on a pending operation of an aborted replication side channel.

A recovery's teardown aborts the failed generation's side channel while its round
thread may be anywhere in a round: in the announce all-gather, a send or a receive of
a replica, with the peer SIGKILLed, SIGSTOPped, or still alive. Shutting down the
group's sockets does not end every pending gloo operation: about one abort in 20 left
a send, a receive or the all-gather waiting for its own timeout (120 s, the
replication default), and the round's thread with it (the 120 s stalls chaos soaks met
once in 40-120 recoveries had the round thread blocked in the all-gather). The channel
now waits on a waiter thread that the abort releases the caller from
(``replication/side_channel/work_waiter.py``, ADR 0037).

Real processes, real gloo (``tests/side_channel_teardown_worker.py``): many trials, each
with a fresh channel and peer and the fault at a random moment. Every trial must release
the round thread within a second of the abort, the abort itself must return within a
second, no trial may last over 30 s, and no Python thread of the survivor may be kept
from running for a second.

The abort's own bound was missing until the stall was traced to its root: the group's
last references were locals of ``SideChannel.abort``, so when the thread meant to drop
them finished first, the group was destroyed as ``abort`` returned, in the caller, and
that waited for the pending operation's timeout. About one trial in 130 took 120 s; the
trials passed, since only the round thread's release and the GIL were checked.
``test_the_aborting_thread_never_destroys_the_group`` makes that order happen every time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch.distributed as dist

from replication.side_channel import transport
from tests.recovery_harness import REPO

pytestmark = pytest.mark.timeout(400)

TRIALS = 40


def test_aborting_a_side_channel_mid_round_never_stalls_the_process():
    seed = int(os.environ.get("CHECKPOINTLESS_TEST_SEED", "7"))
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "side_channel_teardown_worker.py"),
         str(TRIALS), str(seed)],
        cwd=REPO, capture_output=True, text=True, timeout=380,
        env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    trials = result["trials"]
    assert len(trials) == TRIALS
    assert {t["fault"] for t in trials} == {"kill", "stop", "abort_first"}
    slow = [t for t in trials if t["released_s"] > 1.0]
    assert not slow, f"the round thread waited on after the abort: {slow}"
    held = [t for t in trials if t["abort_s"] > 1.0 or t["trial_s"] > 30.0]
    assert not held, (f"the abort, or the trial around it, stood still (seed {seed}): "
                      f"{held}\n{proc.stderr[-3000:]}")
    stalled = [t for t in trials if t["longest_gil_gap_s"] > 1.0]
    assert not stalled, f"the process stood still (seed {seed}): {stalled}"
    for t in trials:
        assert "abandoned" in t["error"] or "failed" in t["error"], t


def test_an_abort_that_reached_no_socket_still_releases_the_round_at_once():
    """The abort made to reach no socket, the peer SIGSTOPped: gloo's operation stays
    pending until the channel's 3 s timeout (and the aborted group is dropped meanwhile),
    but the round's thread is released at the abort, and no other thread of the process
    is held up."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "side_channel_teardown_worker.py"), "2", "1",
         "missed"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    trials = json.loads(proc.stdout.strip().splitlines()[-1])["trials"]
    assert len(trials) == 2
    for t in trials:
        assert t["released_s"] < 1.0, t
        assert t["longest_gil_gap_s"] < 1.0, t
        assert "abandoned" in t["error"], t


class _Backend:
    """Stands for the channel's gloo backend: records the thread that drops its last
    reference, where a real one's destruction waits for a pending operation's timeout."""

    def __init__(self, dropped_in: list[str]) -> None:
        self.dropped_in = dropped_in

    def __del__(self) -> None:
        self.dropped_in.append(threading.current_thread().name)


class _Group:
    """Stands for :class:`replication.side_channel.abortable_gloo.AbortableGloo`: holds the backend
    until released."""

    def __init__(self, backend: _Backend) -> None:
        self.backend: _Backend | None = backend

    def abort(self) -> int:
        return 0

    def release(self) -> None:
        self.backend = None


def test_the_aborting_thread_never_destroys_the_group(monkeypatch):
    """The dropping thread is made to finish before ``abort`` returns (the order that
    stalled one abort in 130): the backend still dies in that thread, never in the
    caller's."""
    ch = transport.SideChannel(dist.HashStore(), 0, 1, prefix="drop", timeout_s=5.0)
    ch.close()  # the real group goes now; stand-ins take its place
    dropped_in: list[str] = []
    backend = _Backend(dropped_in)
    ch._group, ch.pg = _Group(backend), backend
    del backend  # the channel and its group hold it, as in a real one
    start = threading.Thread.start

    def start_and_finish(self: threading.Thread) -> None:
        start(self)
        self.join()  # the dropping thread ends before abort() returns

    monkeypatch.setattr(threading.Thread, "start", start_and_finish)
    ch.abort()
    monkeypatch.undo()
    assert dropped_in == ["checkpointless-side-drop"], dropped_in
