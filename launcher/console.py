"""The ``checkpointless`` console script: quiet through a Ctrl-C during start-up.

The command's imports (torch among them) take a second or more, and a Ctrl-C in that
window printed a KeyboardInterrupt traceback from the middle of an import in every
agent of the machine. This module imports nothing heavy: it makes SIGINT end the
process quietly with status 130 until :mod:`launcher.cli` is imported, then hands over
(the agent installs its own handler; other subcommands get Python's default back).
"""

from __future__ import annotations

import os
import signal
import sys

from replication.contract import EXIT_INTERRUPTED


def _quiet_exit(_signum: int, _frame: object) -> None:
    sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)


def entry() -> None:
    previous = signal.signal(signal.SIGINT, _quiet_exit)
    from launcher.cli import entry as cli_entry

    signal.signal(signal.SIGINT, previous)
    cli_entry()
