"""``checkpointless chaos``: the chaos soak benchmark (``benchmarks/bench_goodput.py``).

Runs a small training job under the real launcher with a seeded random failure
schedule, checks that it ends bit-identical to a failure-free run, and prints goodput
against its analytic bound and against a torchrun + DCP full-restart baseline. The
procedure and every figure are defined in ``benchmarks/bench_goodput.py``; both it and
this command run :mod:`launcher.chaos.soak`, with the same options and the same JSON
line. The soak's training job (``launcher/chaos/workload.py``) trains the GPT of
``examples/gpt.py``, which is not part of the installed package, so the command needs a
source checkout; from one (``make setup`` installs editable), it works from any
directory.
"""

from __future__ import annotations

import argparse
import json
import sys

from replication.contract import EXIT_FAILED, EXIT_OK, EXIT_USAGE


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "chaos", help="chaos soak: train under random failures, report goodput",
        description="Train a small job under a seeded random failure schedule (worker "
                    "kills, hangs, exceptions, node losses, storage outages) and report "
                    "goodput, its bound, a torchrun baseline and bit-identity.",
    )
    from launcher.chaos.soak import add_arguments

    add_arguments(parser)
    parser.set_defaults(handler=_run)


def _unavailable(_args: argparse.Namespace) -> int:
    print("checkpointless: error: 'chaos' needs a source checkout of checkpointless "
          "(run it from the repository root: the benchmark is not installed)", file=sys.stderr)
    return EXIT_USAGE  # nothing ran: the environment cannot run the command


def _run(args: argparse.Namespace) -> int:
    from launcher.chaos.runs import REPO
    from launcher.chaos.soak import Options, run

    if not (REPO / "examples" / "gpt.py").is_file():  # the workload's model
        return _unavailable(args)
    result = run(Options.from_args(args))
    print(json.dumps(result, sort_keys=True), flush=True)
    return EXIT_OK if "error" not in result else EXIT_FAILED
