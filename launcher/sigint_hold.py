"""Ctrl-C held back from a new process until it can handle it.

A Ctrl-C in the terminal reaches every process of the group. One that landed while a
new interpreter was still compiling its bootstrap (``python -m launcher.spare`` takes
more than a second under load where bytecode is not cached) raised KeyboardInterrupt
before any handler of ours existed, and printed a traceback per rank. The signal mask
survives fork and exec, so the agent starts its workers, spares and zygote inside
:func:`sigint_held`; each keeps a Ctrl-C pending until its bootstrap, inside its
handler, calls :func:`release_sigint`. Spares the zygote forks inherit the mask too.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def sigint_held() -> Iterator[None]:
    """Processes started inside begin life with SIGINT blocked. The calling process
    loses nothing: another of its threads takes the signal meanwhile, or it is
    delivered when the mask is restored on the way out."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def release_sigint() -> None:
    """Take Ctrl-C again (a pending one is raised here, as KeyboardInterrupt)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
