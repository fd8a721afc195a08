"""Joining the job store never hangs and says what it waits for.

Real ``checkpointless run`` agents for node rank 1, pointed at ports where node 0's
store is not: nothing listening, a service that accepts and never answers, and one
that answers something else. Before: a silent wait of up to 600 s; and against a
foreign service, a hang in c10d's native receive that ignored SIGTERM and Ctrl-C.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.helpers.mp import free_port
from tests.recovery_harness import REPO, clean_env

pytestmark = pytest.mark.timeout(120)

SCRIPT = str(REPO / "tests" / "user_scripts" / "bug_at_step.py")


def _node1(port: int, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "launcher.cli", "run", "--nnodes", "2", "--node-rank", "1",
           "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", "connect-test", *extra, SCRIPT]
    return subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


class _Foreign:
    """A TCP service on 127.0.0.1 that is not a job store: it accepts, then either
    stays silent (reading and discarding) or answers with ``reply`` and closes."""

    def __init__(self, reply: bytes | None) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.reply = reply
        self.conns: list[socket.socket] = []
        self.first_conn_at: float | None = None  # when the agent first connected
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self.first_conn_at is None:
                self.first_conn_at = time.monotonic()
            self.conns.append(conn)
            if self.reply is not None:
                conn.sendall(self.reply)
                conn.close()

    def close(self) -> None:
        for c in [*self.conns, self.sock]:
            c.close()


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, float]:
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err, time.monotonic() - t0


def _stopped_in_time(service: _Foreign, started: float, ended: float) -> tuple[bool, str]:
    """Whether the agent stopped within its 10 s handshake deadline of its first
    connection, give or take as long again as it took to get there (its exit, like its
    start, is an interpreter's): measured from the agent's own first contact, so a
    loaded host's slow start is not counted as waiting."""
    if service.first_conn_at is None:
        return False, "the agent never connected"
    start, waited = service.first_conn_at - started, ended - service.first_conn_at
    return waited < 10 + max(start, 2.0), f"waited {waited:.1f}s after a {start:.1f}s start"


def _error_lines(err: str) -> list[str]:
    """What the agent printed (one line is expected: no c10d stack traces)."""
    return [line for line in err.splitlines() if line.strip()]


def test_nothing_listening_says_what_it_waits_for_then_stops():
    """The agent waits its 12 s join timeout, saying so every 5 s, then stops. The wait is
    timed from the agent's own first report (5 s into it), not from the process start,
    which a loaded host can make slow: it ends 12 s after it began, give or take as long
    again as the agent took to start (its exit, like its start, is an interpreter's)."""
    port = free_port()
    t0 = time.monotonic()
    proc = _node1(port, "--rdzv-conf", "join_timeout=12")
    first: list[float] = []
    lines: list[str] = []

    def read() -> None:
        for line in proc.stderr:
            if not first and "5s of 12s" in line:
                first.append(time.monotonic())
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    code = proc.wait(timeout=120)
    ended = time.monotonic()
    reader.join(10)
    err = "".join(lines)
    assert code != 0 and first, (code, err)
    began = first[0] - 5.0
    waited, start = ended - began, began - t0
    assert 11 < waited < 12 + max(start, 2.0), (waited, start, err)
    waiting = f"waiting for the job store at 127.0.0.1:{port} (node-rank 0's agent)"
    # said every 5 s while it waits, with how long so far, not once and then silence
    assert f"{waiting}, 5s of 12s" in err and f"{waiting}, 10s of 12s" in err, err
    assert f"cannot reach the job store at 127.0.0.1:{port} within 12s" in err, err
    assert "Traceback" not in err, err


def test_a_silent_foreign_service_is_named_not_waited_on_forever():
    service = _Foreign(reply=None)
    try:
        started = time.monotonic()
        code, err, _ = _finish(_node1(service.port), 90)
        ended = time.monotonic()
    finally:
        service.close()
    in_time, how = _stopped_in_time(service, started, ended)
    assert code != 0 and in_time, (code, how, err)
    lines = _error_lines(err)
    assert len(lines) == 1, err
    assert f"something at 127.0.0.1:{service.port} accepts connections but did not answer " \
           "as a job store" in lines[0], err
    assert "Traceback" not in err, err


def test_a_foreign_service_that_answers_is_a_clear_error():
    service = _Foreign(reply=b"HTTP/1.0 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    try:
        started = time.monotonic()
        code, err, _ = _finish(_node1(service.port), 90)
        ended = time.monotonic()
    finally:
        service.close()
    in_time, how = _stopped_in_time(service, started, ended)
    assert code != 0 and in_time, (code, how, err)
    lines = _error_lines(err)
    assert len(lines) == 1, err
    assert f"127.0.0.1:{service.port}" in lines[0] and "another service" in lines[0], err
    assert "Traceback" not in err, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("where", ["waiting", "handshake"])
def test_a_signal_stops_the_join_at_once(sig, where):
    """Signalled once the agent is provably there: it said it waits (its first report,
    5 s in), or the silent service saw the handshake's connection. (A fixed 4 s sleep
    signalled a loaded CI host's agent while it still imported its commands.)"""
    service = _Foreign(reply=None) if where == "handshake" else None
    port = service.port if service else free_port()
    proc = _node1(port)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()

    def there() -> bool:
        if service:  # the port probe's connection, then the c10d client's
            return len(service.conns) >= 2
        return any("waiting for the job store" in line for line in lines)

    try:
        deadline = time.monotonic() + 60
        while not there():
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.05)
        time.sleep(0.3)
        proc.send_signal(sig)
        t0 = time.monotonic()
        proc.wait(timeout=30)
        took = time.monotonic() - t0
        reader.join(timeout=10)
        code, err = proc.returncode, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
        if service:
            service.close()
    assert took < 3.0, f"took {took:.1f}s to stop after {sig.name}\n{err}"
    assert code != 0, err
    assert "Traceback" not in err, err


def test_only_the_first_connect_captures_stderr_and_the_heartbeats_does_not(monkeypatch):
    """The capture of c10d's retry noise redirects the whole process's fd 2. The agent's
    heartbeat thread connects while the agent's loop starts and prints its first lines
    (its "joined job" line, a storage warning): with the capture on there, they went
    into the capture's temporary file and were lost (seen in
    ``test_storage_probe``'s spare node). The heartbeat's connect leaves fd 2 alone."""
    import inspect
    import os

    import torch.distributed as dist

    from launcher import job_store, liveness

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    redirected: list[int] = []
    real = os.dup2

    def dup2(fd: int, fd2: int, *rest) -> int:
        redirected.append(fd2)
        return real(fd, fd2, *rest)

    monkeypatch.setattr(os, "dup2", dup2)
    quiet = job_store.connect_store("127.0.0.1", master.port, 10.0, capture_log=False)
    quiet.set("k", "v")
    assert redirected == []
    job_store.connect_store("127.0.0.1", master.port, 10.0)  # the agent's first connect
    assert 2 in redirected
    assert "capture_log=False" in inspect.getsource(liveness.Heartbeat.run)
