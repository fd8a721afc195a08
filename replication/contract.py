"""The process contract: environment variable names, exit codes and the job id.

Every process of a job reads or writes these: the console script, the agents, their
workers and warm spares, the durable writer's helper, the cached loader. They are the
interface between processes, so each is defined here once, and this module imports
only the standard library: the lowest layer (``replication``, ``dataloader_cache``)
and the highest (``launcher``) can all import it without pulling in anything else.
Store keys are a different contract and live in ``recovery.generation.protocol``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# -- environment the agent gives each worker, on top of torchrun's variables ----------
#: Every variable the agent sets for its workers starts with this; none is user-facing.
INTERNAL_PREFIX = "CHECKPOINTLESS_INTERNAL_"
ENV_STORE = f"{INTERNAL_PREFIX}STORE"  # host:port of the job's c10d store
ENV_NODE = f"{INTERNAL_PREFIX}NODE"  # the physical node (agent) id of this worker
ENV_RUN_DIR = f"{INTERNAL_PREFIX}RUN_DIR"  # events.jsonl and logs go here
ENV_HEARTBEAT = f"{INTERNAL_PREFIX}HEARTBEAT"  # file whose mtime the agent watches
ENV_JOB_ID = f"{INTERNAL_PREFIX}JOB_ID"  # the job id (torchrun's --rdzv-id)
ENV_REPLACEMENT = f"{INTERNAL_PREFIX}REPLACEMENT"  # "1": a replacement joining mid-job
#: "drain": a SIGTERM is the scheduler's, sent to every process of the job step; workers
#: ignore it and their agent stops them (``recovery.runtime.drain``). Unset: the default action.
ENV_ON_SIGTERM = f"{INTERNAL_PREFIX}ON_SIGTERM"
#: The job key (hex) that seals trusted records (``replication.side_channel.signing``); never
#: logged.
ENV_JOB_KEY = f"{INTERNAL_PREFIX}JOB_KEY"
#: The resolved recipe as JSON, from the launcher to its workers (``recovery.recipe``).
ENV_CONFIG = "CHECKPOINTLESS_CONFIG_JSON"

# -- environment a user may set ---------------------------------------------------------
#: The job secret every node's agent shares; removed before workers start.
ENV_JOB_SECRET = "CHECKPOINTLESS_JOB_SECRET"
#: Where ``checkpointless run`` writes its exit status as it ends (``<path>.node<R>``):
#: a batch script reads every node's there (srun reports only the highest status, and a
#: node killed mid-job, 137, would hide the others' 0).
ENV_STATUS_FILE = "CHECKPOINTLESS_STATUS_FILE"
#: torchrun's job id, the fallback for scripts run under plain torchrun.
ENV_TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"

# -- exit codes -----------------------------------------------------------------------
EXIT_OK = 0
EXIT_FAILED = 1  # the job failed (or a command found damage); the reason was printed
EXIT_USAGE = 2  # bad command line or configuration: nothing ran
EXIT_FATAL = 3  # a worker: recovery impossible; the reason is the job's fatal record
EXIT_FENCED = 4  # a worker or agent: its node was declared lost and its ranks taken over
#: The job stopped for a cause outside the script (every copy of a state lost, no spare
#: node, too many failures, the job store lost): a new allocation can go on, from
#: ``persistence.path`` where one is set (sysexits' EX_TEMPFAIL). A scheduler requeues.
EXIT_RETRY = 75
#: The script failed the way every retry would (an exception before its first step, or
#: the same one again after a rollback): a scheduler must not requeue.
EXIT_SCRIPT_ERROR = 93
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as shells report it


def job_id(environ: Mapping[str, str] | None = None) -> str | None:
    """This job's id: the launcher's (:data:`ENV_JOB_ID`), else torchrun's, else None."""
    env = os.environ if environ is None else environ
    return env.get(ENV_JOB_ID) or env.get(ENV_TORCHELASTIC_RUN_ID) or None
