"""The agent's poll loop sleeps until its next pass or until a signal comes
(``launcher/loop_wakeup.py``): a child's exit ends the sleep at once, and no Python code
runs inside the signal handler (a ``threading.Event`` set from a SIGCHLD handler once
deadlocked an agent on the Event's own lock)."""

from __future__ import annotations

import os
import signal
import time

from launcher.loop_wakeup import LoopWakeup


def test_a_child_exit_ends_the_sleep_at_once():
    wakeup = LoopWakeup()
    try:
        wakeup.clear()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        t0 = time.monotonic()
        wakeup.sleep(10.0)
        assert time.monotonic() - t0 < 2.0
        os.waitpid(pid, 0)
        wakeup.clear()  # consumed: the next sleep lasts its whole timeout
        t0 = time.monotonic()
        wakeup.sleep(0.2)
        assert time.monotonic() - t0 >= 0.19
    finally:
        wakeup.close()


def test_close_puts_back_the_previous_handler_and_wakeup_fd():
    before = signal.getsignal(signal.SIGCHLD)
    wakeup = LoopWakeup()
    assert signal.getsignal(signal.SIGCHLD) is not before
    wakeup.close()
    assert signal.getsignal(signal.SIGCHLD) is before
    previous = signal.set_wakeup_fd(-1)  # what is installed now: the one before, -1
    assert previous == -1
