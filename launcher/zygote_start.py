"""Whether an agent gets a zygote, and which one (ADR 0011, ADR 0029).

Kept apart from :mod:`launcher.zygote` (the process and its protocol) and from the agent
(which only asks for one): the decision depends on the command line and what the
kernel allows (every build of torch forks its workers: the zygote keeps CUDA
uninitialised and refuses a fork where it is not, :func:`launcher.zygote.fork_hazard`),
and it picks between a zygote forked from the agent itself and one started as a new
interpreter.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from launcher import reaper, script_imports
from launcher.run_args import RunArgs
from launcher.zygote import Zygote


def wants_zygote(args: RunArgs) -> bool:
    """A zygote for spares (ADR 0011) and for every worker (ADR 0029; on GPU builds too,
    see :func:`launcher.zygote.fork_hazard`), unless ``--no-zygote``."""
    return args.zygote


def start_zygote(
    args: RunArgs, early: Zygote | None, env: Mapping[str, str],
    emit: Callable[..., object], log: Callable[[str], None],
) -> Zygote | None:
    """The agent's zygote, or None; with one, the agent has become a child subreaper
    (the forks are reparented to it). ``early`` is a zygote the agent forked from itself
    before it started (:meth:`Zygote.fork_early`): it is configured and used, or
    stopped when none is wanted; without it a new interpreter is started."""
    if not wants_zygote(args):
        if early is not None:
            early.stop()
        return None
    if not reaper.become_subreaper():
        log("cannot adopt forked workers here (no PR_SET_CHILD_SUBREAPER): "
            "each worker and spare imports torch itself")
        if early is not None:
            early.stop()
        return None
    if early is not None:  # forked from the agent: it only needs the job's environment
        # for the first workers (ADR 0029)
        warm = script_imports.frameworks_to_warm(args.script, args.module)
        early.configure(env, emit, warm, preload=preload_list(args), log=log,
                        path0=worker_path0(args))
        return early
    zygote = Zygote(env, emit, log=log)
    zygote.start(preload=preload_list(args), path0=worker_path0(args))
    return zygote


def preload_list(args: RunArgs) -> list[str]:
    """What the zygote imports of the script's own modules before it forks (checked
    there first, :mod:`launcher.preload`): ``--preload`` adds, ``--no-preload`` takes
    away."""
    return script_imports.modules_to_preload(args.script, args.module, args.preload,
                                             args.no_preload)


def worker_path0(args: RunArgs) -> str | None:
    """The first entry of a worker's ``sys.path``: the script's directory, as
    ``python script.py`` has it (``-m``: the working directory, as the zygote has it)."""
    if args.module:
        return None
    return os.path.dirname(os.path.realpath(args.script))
