"""What the kernel says about a process: its scheduler state and the CPU time it used.

A worker proves it is alive by touching its heartbeat file from a thread. On a busy host
that thread can be starved for seconds (it waits for a core, or for the GIL held by a
main thread the scheduler took a core from) while the worker itself is healthy. The
agent asks the kernel before it declares a silent worker hung
(:meth:`launcher.worker_procs.Worker.observe`): a stopped process (SIGSTOP, a debugger)
is hung, one that runs, waits for a core or waits on the disk is busy, not hung.

Read from ``/proc/<pid>/stat`` (Linux); where it cannot be read, :func:`read` returns
None and the heartbeat alone decides, as before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01

#: Scheduler states of a process that is making progress or is held by the kernel:
#: running or runnable (``R``, waiting for a core on a busy host) and uninterruptible
#: sleep (``D``, waiting on the disk or the network filesystem).
BUSY_STATES = frozenset("RD")
#: A process that will not run again until someone resumes it: SIGSTOP (``T``) or a
#: tracer's stop (``t``).
STOPPED_STATES = frozenset("Tt")


@dataclass(frozen=True)
class ProcessView:
    state: str  # one letter of proc(5): R, S, D, T, t, Z, ...
    cpu_s: float  # user + system time of all its threads so far

    @property
    def stopped(self) -> bool:
        return self.state in STOPPED_STATES

    @property
    def busy(self) -> bool:
        return self.state in BUSY_STATES


def read(pid: int) -> ProcessView | None:
    """The kernel's view of ``pid`` now, or None where there is no ``/proc`` for it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces or ")".
    fields = raw[raw.rfind(b")") + 2:].split()
    try:
        state = fields[0].decode()
        utime, stime = int(fields[11]), int(fields[12])
    except (IndexError, ValueError):
        return None
    return ProcessView(state=state, cpu_s=(utime + stime) * _TICK_S)
