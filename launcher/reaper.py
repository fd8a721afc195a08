"""The agent as a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``).

Warm spares forked by the zygote (:mod:`launcher.zygote`) are the zygote's
grandchildren: the zygote forks an intermediate process that forks the spare and exits,
and the kernel reparents the orphaned spare to its nearest subreaper ancestor, the
agent. The agent can then ``waitpid`` it like any worker it started itself.

Being a subreaper also makes the agent the parent of every other orphan below it (the
durable helper of a SIGKILLed worker, for instance), so it must reap those too, or they
stay zombies for the life of the job: :func:`reap_orphans`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Collection

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Adopt orphaned descendants; False where the platform does not support it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def reap_orphans(known: Collection[int]) -> list[int]:
    """Reap exited children whose pids are not in ``known`` (those belong to a
    ``Popen``/``ForkedProcess`` that collects its own status). Returns the reaped pids."""
    reaped = []
    for pid in _zombie_children():
        if pid in known:
            continue
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                reaped.append(pid)
    return reaped


def _zombie_children() -> list[int]:
    me = os.getpid()
    found = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) >= 2 and fields[0] == b"Z" and int(fields[1]) == me:
            found.append(int(name))
    return found
