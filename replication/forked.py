"""A ``subprocess.Popen``-like handle for a child process that ``subprocess`` did not start.

Two kinds of processes are started by ``fork`` rather than by ``Popen``, so that they
skip ``import torch`` (seconds of CPU that training would otherwise lose):

- a durable writer's helper, forked by a warm spare before it becomes a rank
  (:func:`replication.durable.worker.prefork_helper`);
- a warm spare, forked by the agent's zygote and reparented to the agent, which is a
  child subreaper (:mod:`launcher.zygote`).

Either way the holder is the process's parent and can ``waitpid`` it. This class gives
the callers the part of ``Popen`` they use (``pid``, ``returncode``, ``poll``, ``wait``,
signals and the pipe attributes), so the code that watches workers and helpers does not
care how they were started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from typing import IO


class ForkedProcess:
    """A child of this process, known by pid. ``returncode`` follows Popen's convention:
    the exit status, or ``-N`` for death by signal N."""

    def __init__(
        self,
        pid: int,
        *,
        stdin: IO[bytes] | None = None,
        stdout: IO[bytes] | None = None,
        stderr: IO[bytes] | None = None,
        args: object = None,
    ) -> None:
        self.pid = pid
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.args = args if args is not None else f"<forked {pid}>"
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._reap(os.WNOHANG)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            while self.returncode is None:
                self._reap(0)
            return self.returncode
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while self.poll() is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.05)
        assert self.returncode is not None
        return self.returncode

    def _reap(self, flags: int) -> None:
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:
            # Not (or no longer) our child: someone else reaped it. Like Popen, report a
            # plain exit rather than block forever; callers only see this after misuse.
            self.returncode = 0 if self.returncode is None else self.returncode
            return
        if pid == self.pid:
            self.returncode = os.waitstatus_to_exitcode(status)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __repr__(self) -> str:
        return f"ForkedProcess(pid={self.pid}, returncode={self.returncode})"
