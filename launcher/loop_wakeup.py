"""The agent's poll loop sleeps until its next pass or until a signal comes.

The loop looks at its workers every ``--monitor-interval`` (50 ms by default). A worker
that dies in between used to wait for the next pass: 0-50 ms added to every recovery,
on top of the kernel's teardown of the dead process. The kernel tells the parent at
once (SIGCHLD), so the loop's sleep ends on it, and on the agent's own signals.

How: :func:`signal.set_wakeup_fd`. Python's C-level handler writes a byte to a
non-blocking pipe for each signal that has a Python handler, and the loop's sleep is a
``select`` on that pipe. Nothing here runs Python code inside a signal handler: an
earlier version set a ``threading.Event`` from a SIGCHLD handler, and the handler,
which runs in the main thread between two bytecodes, could find the main thread itself
holding that event's lock (in ``clear()``, or entering ``wait()``) and wait for it
forever; under load an agent hung that way at the end of a job.

SIGCHLD gets SA_RESTART (:func:`signal.siginterrupt`), so a system call another thread
is in is restarted rather than failed with EINTR (torch's socket code retries EINTR
anyway). :meth:`LoopWakeup.close` puts back the previous handler and wakeup fd: tests
run agents in-process.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from typing import Any


class LoopWakeup:
    """A pipe the loop sleeps on, written by Python's signal machinery."""

    def __init__(self) -> None:
        """Install it; call from the main thread (signals are only handled there)."""
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._previous_sigchld: Any = signal.signal(signal.SIGCHLD, _ignore)
        signal.siginterrupt(signal.SIGCHLD, False)

    def clear(self) -> None:
        """Forget the signals seen so far (the pass about to run sees their effects)."""
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while os.read(self._read, 4096):
                pass

    def sleep(self, timeout_s: float) -> None:
        """Return after ``timeout_s``, or as soon as a signal came since :meth:`clear`."""
        select.select([self._read], [], [], timeout_s)

    def close(self) -> None:
        signal.signal(signal.SIGCHLD, self._previous_sigchld)
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._read)
        os.close(self._write)


def _ignore(_signum: int, _frame: Any) -> None:
    """SIGCHLD's Python handler: its only effect is the byte written to the pipe."""
