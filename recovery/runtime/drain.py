"""A stop for the scheduler: persist the newest committed step, then leave with 75.

Under Slurm a SIGTERM reaches every node's agent at once: ``scancel``, a preemption, the
time limit's ``--signal``. The job is stopping, not losing a node, so nothing is
recovered. The first agent to get the signal records the stop as the job's fatal
record, of kind :data:`DRAIN_KIND` (every agent reads that record on each pass, so a
node whose own signal is late stops too). Each agent marks its workers' heartbeat files
(``<heartbeat>.stop``), and each worker, at its next step boundary or at the failure a
departed peer causes, waits for the replication round in flight, persists the newest
committed step through its durable writer (every rank the same step: a complete
checkpoint), and exits with :data:`replication.contract.EXIT_RETRY`. The next run
resumes from that checkpoint (``persistence.resume: auto``). Without
``persistence.path`` there is nothing to write: the stop is said, and the next run
starts afresh.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING, NoReturn

import torch.distributed as dist

from recovery.common.events import Event
from recovery.generation import protocol
from replication import contract

if TYPE_CHECKING:
    from recovery.runtime.checkpointless import Checkpointless

#: The suffix of the file that asks a worker to stop for the scheduler.
STOP_SUFFIX = ".stop"
#: The ``kind`` of the job's fatal record when the job stops for its scheduler.
DRAIN_KIND = "drain"


def request(store: dist.Store, node: int, signal_name: str) -> None:
    """Record that the job stops for its scheduler (first fatal reason wins)."""
    protocol.set_fatal(store, f"stopped for the scheduler ({signal_name} on node {node}): "
                       "the newest committed step is persisted", kind=DRAIN_KIND,
                       signal=signal_name)


def is_drain(failure: dict | None) -> bool:
    """Whether the job's fatal record is a stop for the scheduler."""
    return bool(failure) and failure.get("kind") == DRAIN_KIND


def job_draining(store: dist.Store) -> bool:
    """Whether the job stops for its scheduler (a store read: for failure paths)."""
    try:
        return is_drain(protocol.fatal(store))
    except Exception:  # the store is going away with the job
        return False


def requested(heartbeat_file: str | None) -> bool:
    """Whether this worker's agent asked it to stop (a stat of a local file)."""
    return bool(heartbeat_file) and os.path.exists(heartbeat_file + STOP_SUFFIX)


def stop_for_scheduler(rt: Checkpointless) -> NoReturn:
    """Persist the newest committed step and end this process with 75."""
    with contextlib.suppress(Exception):  # a peer left mid-round: an older step is committed
        rt.wait_committed()
    try:
        step = rt.committed_step
    except Exception:
        step = -1
    saved = rt.durable.drain(rt.replicator, step)
    rt.log.emit(Event.DRAINED, rank=rt.rank, step=step, persisted=saved)
    if rt.rank == 0:
        where = (f"persisted step {saved} to {rt.settings.persistence.path}" if saved is not None
                 else "nothing persisted (no persistence.path)" if rt.durable.writer is None
                 else "no step to persist yet" if step <= 0
                 else f"the save of step {step} failed (see above)")
        print(f"checkpointless: stopped for the scheduler at committed step {step}: {where}; "
              f"exit {contract.EXIT_RETRY} (a new run resumes from the newest durable "
              "checkpoint)", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(contract.EXIT_RETRY)
