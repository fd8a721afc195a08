"""Every process a chaos run starts, found and ended by a token in its environment.

A chaos run starts agents, which start workers, warm spares and durable-writer
helpers; torchrun starts workers in sessions of their own; a killed agent orphans
whatever it had not taken down with it. Process groups and parent links therefore
cannot find everything. The environment can: every process the run starts carries
``CHAOS_SOAK_TOKEN=<token>`` and passes it on to its children, so
:func:`tracked` finds all of them wherever they ended up in the process tree, and
:func:`kill_tracked` ends them by pid. The harness also makes itself a *child
subreaper* (Linux), so orphans are reparented to it rather than to init and it can
reap them (:func:`reap_orphans`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterable

import psutil

from launcher.reaper import become_subreaper  # noqa: F401  (the harness adopts orphans)

TOKEN_ENV = "CHAOS_SOAK_TOKEN"  # not CHECKPOINTLESS_*: that prefix is the recipe's


def new_token(tag: str = "") -> str:
    return f"chaos-{os.getpid()}-{uuid.uuid4().hex[:12]}{'-' + tag if tag else ''}"


def tracked(token: str) -> list[psutil.Process]:
    """Live (non-zombie) processes whose environment carries ``token``."""
    found = []
    for p in psutil.process_iter(["pid"]):
        if p.pid == os.getpid():
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get(TOKEN_ENV) == token:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def kill_tracked(token: str, timeout_s: float = 10.0) -> int:
    """SIGKILL every process carrying ``token`` (SIGCONT first: some may be stopped).

    Repeats until none is left or ``timeout_s`` passes (a process may fork while the
    first sweep runs). Returns how many processes it signalled.
    """
    deadline = time.monotonic() + timeout_s
    killed = 0
    while True:
        procs = tracked(token)
        if not procs:
            return killed
        for p in procs:
            with contextlib.suppress(psutil.Error, OSError):
                p.send_signal(signal.SIGCONT)
                p.kill()
                killed += 1
        psutil.wait_procs(procs, timeout=2.0)
        reap_orphans()
        if time.monotonic() > deadline:
            return killed


def reap_orphans(keep: Iterable[int] = ()) -> None:
    """Reap zombie children that no ``subprocess.Popen`` of ours owns.

    ``keep`` lists the pids our Popen objects wait for themselves: reaping those here
    would make ``Popen.poll`` report exit status 0 for them.
    """
    skip = set(keep)
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process().children():
            if child.pid in skip:
                continue
            with contextlib.suppress(psutil.Error, ChildProcessError, OSError):
                if child.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(child.pid, os.WNOHANG)


def describe(procs: Iterable[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            out.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
    return out

