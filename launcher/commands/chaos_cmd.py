"""``checkpointless chaos``: the chaos soak benchmark (``benchmarks/bench_goodput.py``).

Runs a small training job under the real launcher with a seeded random failure
schedule, checks that it ends bit-identical to a failure-free run, and prints goodput
against its analytic bound and against a torchrun + DCP full-restart baseline. The
procedure and every figure are defined in ``benchmarks/bench_goodput.py``; this
command only parses the same options and prints the same JSON line. It needs a
source checkout (the benchmark and its worker are not part of the installed package);
from one (``make setup`` installs editable), it works from any directory.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "chaos", help="chaos soak: train under random failures, report goodput",
        description="Train a small job under a seeded random failure schedule (worker "
                    "kills, hangs, exceptions, node losses, storage outages) and report "
                    "goodput, its bound, a torchrun baseline and bit-identity.",
    )
    _find_checkout()
    try:
        from benchmarks.chaos.soak import add_arguments
    except ImportError:
        parser.set_defaults(handler=_unavailable)
        return
    add_arguments(parser)
    parser.set_defaults(handler=_run)


def _find_checkout() -> None:
    """Make ``benchmarks`` importable from any directory when this package runs from a
    source checkout (``make setup`` installs it editable): the checkout is the parent of
    the ``launcher`` package. A wheel install has no ``benchmarks`` beside it."""
    root = Path(__file__).resolve().parents[2]
    if (root / "benchmarks" / "chaos" / "soak.py").is_file() and str(root) not in sys.path:
        sys.path.append(str(root))


def _unavailable(_args: argparse.Namespace) -> int:
    print("checkpointless: error: 'chaos' needs a source checkout of checkpointless "
          "(run it from the repository root: the benchmark is not installed)", file=sys.stderr)
    return 2


def _run(args: argparse.Namespace) -> int:
    from benchmarks.chaos.soak import Options, run

    result = run(Options.from_args(args))
    print(json.dumps(result, sort_keys=True), flush=True)
    return 0 if "error" not in result else 1
