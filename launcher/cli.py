"""The ``checkpointless`` command line: parse, dispatch to a subcommand, report errors.

Bad input (a recipe, an override, an env var) must read like a compiler error, never
like a crash: every :class:`ConfigError` becomes ``checkpointless: error: ...`` on
stderr with exit status 2, the same status argparse uses for usage errors. A real
bug still shows its traceback, because hiding it would cost more than it saves.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from launcher.commands import load_commands
from recovery.recipe import ConfigError
from replication.contract import EXIT_INTERRUPTED, EXIT_USAGE

PROG = "checkpointless"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Keep PyTorch training alive through rank and node failures.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in load_commands():
        module.register(subparsers)
    return parser


def version() -> str:
    """The installed distribution's version, with torch's (what a bug report needs)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        ours = dist_version(PROG)
    except PackageNotFoundError:  # run from a checkout that was never installed
        ours = "(not installed)"
    try:
        torch_version = dist_version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    return f"{ours} (torch {torch_version}, python {sys.version.split()[0]})"


def error(message: str) -> int:
    """Print ``message`` the way argparse prints usage errors; return the exit status."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    return _main(argv)[0]


def _main(argv: Sequence[str] | None) -> tuple[int, bool]:
    """(exit status, whether the process should end without interpreter teardown)."""
    try:
        parser = build_parser()
    except KeyboardInterrupt:  # Ctrl-C while the commands load (seconds on a busy host)
        return EXIT_INTERRUPTED, False
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2): return, do not exit
        return (exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)), False
    try:
        return int(args.handler(args)), bool(getattr(args, "hard_exit", False))
    except ConfigError as exc:
        return error(str(exc)), False
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED, False


def entry() -> NoReturn:
    """The program (console script ``checkpointless``, ``python -m launcher.cli``).

    After ``run``, the agent has finished and said so; the process then ends without
    interpreter teardown. Destroying torch's C++ store objects while a daemon thread may
    still be inside one can abort the process ("terminate called without an active
    exception", seen as exit -6 after "job done"), which would turn a finished job into
    a failed node. Only here, never in :func:`main`, which tests call in-process.

    The agent forks its zygote early (:meth:`launcher.zygote.Zygote.fork_early`); the
    child unwinds to here and becomes the zygote, so that the workers forked from it
    end through this frame as ``python SCRIPT`` would.
    """
    from launcher import zygote

    zygote.early_fork_allowed = True
    child_fd: int | None = None
    try:
        code, hard = _main(None)
    except zygote.BecomeZygote as child:  # the agent's early fork (ADR 0029), in the child
        child_fd = child.fd
    if child_fd is not None:  # outside the handler: a script's error must not chain to it
        sys.exit(zygote.run_forked(child_fd))
    if hard:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
