"""The agent's verdict on a worker whose heartbeat went silent, asked of the kernel.

A heartbeat thread can be starved for seconds on a busy host while its worker is
healthy; under the full suite beside a competing load, a healthy rank was once declared
hung and replaced that way. :meth:`launcher.worker_procs.Worker.observe` now asks the
kernel (:mod:`launcher.process_view`) before it declares a silent worker hung. Each
case here is a real process in the state it names: stopped by SIGSTOP, blocked on a
lock for ever, computing without beating, and runnable but starved of a core by a
competing process. The silence is measured against the same ``timeout_s`` in every
case: only the kernel's view differs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher import process_view
from launcher.worker_procs import ALIVE, BUSY_LIMIT, HUNG, LATE, Worker, make_heartbeat_file

TIMEOUT_S = 1.0
#: "At the timeout": well before the busy limit, which is what tells the verdicts apart
#: (the watching loop itself may run late on a loaded host).
_SOON = (1 + BUSY_LIMIT) / 2 * TIMEOUT_S

_BLOCKED = "import threading; lock = threading.Lock(); lock.acquire(); lock.acquire()"
_COMPUTING = "x = 0\nwhile True:\n    x = (x * 31 + 7) % 1000003\n"


def _start(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def _worker(proc: subprocess.Popen, tmp_path: Path) -> Worker:
    hb = str(tmp_path / "hb")
    make_heartbeat_file(hb)
    w = Worker(rank=1, local_rank=1, group_rank=0, proc=proc, heartbeat=hb,
               restart_count=0, gen_seen=0)
    os.utime(hb)  # one beat: armed, then silent from here on
    assert w.observe(0, TIMEOUT_S) == ALIVE
    return w


def _watch(w: Worker, seconds: float) -> list[tuple[float, str]]:
    """Observe every 50 ms, as the agent's loop does; (seconds since the beat, verdict)."""
    seen = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        verdict = w.observe(0, TIMEOUT_S)
        seen.append((time.monotonic() - w.beat_seen_at, verdict))
        if verdict == HUNG:
            break
        time.sleep(0.05)
    return seen


def _first(seen: list[tuple[float, str]], verdict: str) -> float | None:
    return next((t for t, v in seen if v == verdict), None)


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def _until(what, seconds: float = 30.0):
    """Poll ``what()`` until it returns something true (a loaded host is slow to start
    an interpreter); fails after ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if (got := what()):
            return got
        time.sleep(0.02)
    raise AssertionError(f"not within {seconds}s")


def _settled(pid: int) -> bool:
    """The process is past its start-up: asleep, and using no CPU over 0.2 s."""
    a = process_view.read(pid)
    time.sleep(0.2)
    b = process_view.read(pid)
    return bool(a and b and b.state == "S" and b.cpu_s == a.cpu_s)


def test_the_kernel_view_reads_state_and_cpu_time(procs):
    proc = _start(_COMPUTING)
    procs.append(proc)
    first = _until(lambda: process_view.read(proc.pid))
    later = _until(lambda: (v := process_view.read(proc.pid)) and v.cpu_s > first.cpu_s and v)
    assert later.state == "R" and later.busy and not later.stopped
    os.kill(proc.pid, signal.SIGSTOP)
    stopped = _until(lambda: (v := process_view.read(proc.pid)) and v.stopped and v)
    assert not stopped.busy
    assert process_view.read(2 ** 22 + 12345) is None  # no such pid


def test_a_stopped_worker_is_hung_at_the_timeout(tmp_path, procs):
    proc = _start(_COMPUTING)
    procs.append(proc)
    os.kill(proc.pid, signal.SIGSTOP)
    w = _worker(proc, tmp_path)
    seen = _watch(w, 4 * TIMEOUT_S)
    hung = _first(seen, HUNG)
    assert hung is not None and TIMEOUT_S < hung < _SOON, seen
    assert "stopped" in w.hung_because


def test_a_worker_blocked_for_ever_is_hung_one_timeout_after_it_last_worked(tmp_path, procs):
    proc = _start(_BLOCKED)
    procs.append(proc)
    _until(lambda: _settled(proc.pid))  # past its start-up, which uses CPU
    w = _worker(proc, tmp_path)
    seen = _watch(w, 4 * TIMEOUT_S)
    hung = _first(seen, HUNG)
    assert hung is not None and TIMEOUT_S < hung < _SOON, seen
    assert w.hung_because == "no CPU time, not runnable"


def test_a_worker_at_work_without_beating_is_late_then_hung_at_the_busy_limit(tmp_path,
                                                                              procs):
    """A native call that holds the GIL keeps the heartbeat thread out while the worker
    computes: that is said once, and declared a hang only at the busy limit."""
    proc = _start(_COMPUTING)
    procs.append(proc)
    w = _worker(proc, tmp_path)
    seen = _watch(w, (BUSY_LIMIT + 2) * TIMEOUT_S)
    late, hung = _first(seen, LATE), _first(seen, HUNG)
    assert late is not None and TIMEOUT_S < late < _SOON, seen
    assert [v for _, v in seen].count(LATE) == 1
    assert hung is not None and BUSY_LIMIT * TIMEOUT_S < hung < (BUSY_LIMIT + 1.5) * TIMEOUT_S
    assert "at work" in w.hung_because


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux scheduler calls")
def test_a_worker_starved_of_a_core_is_not_hung(tmp_path, procs):
    """The failure seen under load: a healthy process that gets almost no CPU, because
    other processes hold the cores, stays silent past the timeout. It is runnable, so it
    is late, never hung (before the kernel was asked, it was killed at the timeout)."""
    core = {min(os.sched_getaffinity(0))}
    burner = _start(_COMPUTING)
    procs.append(burner)
    os.sched_setaffinity(burner.pid, core)
    starved = _start(_COMPUTING)
    procs.append(starved)
    os.sched_setaffinity(starved.pid, core)
    os.sched_setscheduler(starved.pid, os.SCHED_IDLE, os.sched_param(0))
    w = _worker(starved, tmp_path)
    seen = _watch(w, 3 * TIMEOUT_S)
    assert _first(seen, HUNG) is None, seen
    assert _first(seen, LATE) is not None, seen
