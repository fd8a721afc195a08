"""``checkpointless run``: torchrun's command line, with an agent that recovers in place.

This module only wires the command line to the agent: parse (``launcher.run_args``),
resolve the recipe exactly as ``checkpointless config show`` would, pick the run
directory, and hand over to :class:`launcher.agent.Agent`. The agent (and torch) are
imported only when the command actually runs, so ``checkpointless --help`` stays fast.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys
from typing import NoReturn

from launcher.run_args import RunArgs, UsageError, add_arguments, from_namespace, prepare
from recovery.recipe import CheckpointlessConfig, load_config, read_recipe
from recovery.recipe.fields import fields_by_path
from recovery.recipe.schema import BLOCK_KEY
from replication.contract import ENV_STATUS_FILE, EXIT_USAGE

PROG = "checkpointless"
_MAX_RESTARTS_PATH = ("recovery", "max_restarts")

DESCRIPTION = """\
Launch SCRIPT on this node like torchrun, and keep the job alive through failures:
a failed or hung worker is replaced (by a warm spare when one is idle) while the
other workers keep running, and the ranks of a lost node are taken over by a spare
node (an agent started with --node-rank >= --nnodes).

Run one agent per node with the same --nnodes, --nproc-per-node, --rdzv-endpoint,
--rdzv-id and job secret (CHECKPOINTLESS_JOB_SECRET or --job-secret-file); node rank 0
hosts the job's store."""

EPILOG = """\
examples:
  checkpointless run --standalone --nproc-per-node 4 train.py --lr 0.1
  checkpointless run --nproc-per-node 2 replication.factor=2 train.py
  checkpointless run --nnodes 2 --node-rank 0 --rdzv-endpoint head:29400 \\
      --rdzv-id job1 --job-secret-file job.secret --recipe recipe.yaml train.py
  checkpointless run --nnodes 2 --node-rank 2 --rdzv-endpoint head:29400 \\
      --rdzv-id job1 --job-secret-file job.secret --recipe recipe.yaml train.py  # spare

KEY=VALUE arguments before SCRIPT override the recipe (see 'checkpointless config
show --help' for every key). Workers get torchrun's environment (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, ...) plus CHECKPOINTLESS_* variables for the runtime.
Events go to <run dir>/events.jsonl.

exit status: 0 when every rank finished, 1 when the job failed (the reason is
printed), 2 for bad input, 128+N when stopped by signal N."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="launch a training script (torchrun-compatible) and keep it alive",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # a prefix of a flag must not quietly mean the flag
    )
    add_arguments(parser)
    parser.error = functools.partial(_usage_error, parser)  # type: ignore[method-assign]
    parser.set_defaults(handler=functools.partial(_run, parser))


def _usage_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    parser.print_usage(sys.stderr)
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


def _run(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    try:
        args = prepare(from_namespace(parser, ns))  # + the job secret and bind address
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exc:  # a flag after an override was bad; already reported
        return int(exc.code or 0)
    cfg = resolve_config(args)  # a ConfigError is reported by the CLI (exit 2)
    if cfg.recovery.metrics_port and importlib.util.find_spec("prometheus_client") is None:
        print(f"{PROG}: error: recovery.metrics_port is set but prometheus_client is not "
              "installed: pip install 'checkpointless[metrics]'", file=sys.stderr)
        return EXIT_USAGE
    if args.placement and args.node_rank == 0:
        print(args.placement, file=sys.stderr, flush=True)
    try:
        run_dir = resolve_run_dir(args, cfg)
    except (OSError, ValueError) as exc:  # not creatable: a file there, too long, no access
        print(f"{PROG}: error: cannot create the run directory: {exc}", file=sys.stderr)
        return EXIT_USAGE

    from launcher import zygote, zygote_start
    from launcher.agent import Agent  # torch comes in here

    # Still one thread and no job store: the zygote can be forked from here and inherit
    # the imports (ADR 0029); the agent hands it the job's environment once it has one.
    early = (zygote.Zygote.fork_early()
             if zygote.early_fork_allowed and zygote_start.wants_zygote(args) else None)
    code = Agent(args, cfg, run_dir, zygote=early).run()
    _write_status(args, code)
    # Asks the program's entry point (launcher.cli.entry, which says why) to end this
    # process without interpreter teardown; callers of main() in-process are unaffected.
    ns.hard_exit = True
    return code


def _write_status(args: RunArgs, code: int) -> None:
    """This node's exit status, for a batch script (``contract.ENV_STATUS_FILE``)."""
    path = os.environ.get(ENV_STATUS_FILE)
    if not path:
        return
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(f"{path}.node{args.node_rank}", "w") as f:
            f.write(f"{code}\n")
    except OSError as exc:  # the status is a courtesy to the batch script
        print(f"{PROG}: could not write the exit status to {path}: {exc}", file=sys.stderr)


def resolve_config(args: RunArgs) -> CheckpointlessConfig:
    """The recipe, env and overrides; ``--max-restarts`` fills in only when none sets it."""
    overrides = list(args.overrides)
    if args.max_restarts is not None and not sets_max_restarts(args.recipe, overrides):
        overrides.insert(0, f"{'.'.join(_MAX_RESTARTS_PATH)}={args.max_restarts}")
    return load_config(args.recipe, overrides)


def sets_max_restarts(recipe: str | None, overrides: list[str]) -> bool:
    """Does the recipe, a ``CHECKPOINTLESS_*`` variable or an override set it explicitly?"""
    for item in overrides:
        path = tuple(item.partition("=")[0].strip().split("."))
        if path[:1] == (BLOCK_KEY,):
            path = path[1:]
        if path == _MAX_RESTARTS_PATH:
            return True
    if fields_by_path()[_MAX_RESTARTS_PATH].env_var in os.environ:
        return True
    if recipe:
        data = read_recipe(recipe).data
        section = data.get(_MAX_RESTARTS_PATH[0]) if isinstance(data, dict) else None
        return isinstance(section, dict) and _MAX_RESTARTS_PATH[1] in section
    return False


def resolve_run_dir(args: RunArgs, cfg: CheckpointlessConfig) -> str:
    """``--run-dir``, else the recipe's ``run_dir``, else ``./runs/<rdzv id>``."""
    chosen = args.run_dir or cfg.run_dir or os.path.join("runs", args.rdzv_id)
    path = os.path.abspath(chosen)
    os.makedirs(path, exist_ok=True)
    return path
