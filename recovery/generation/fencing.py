"""A worker whose node was declared lost while it was only slow leaves the job.

The agents decide who owns a node's group of ranks (``launcher.membership``): a spare
node that takes it over, or the job shrinking without it (ADR 0010, ADR 0035). A worker
of the old owner must then never take part in a generation again, since its rank runs
elsewhere now or no longer exists: it reads the owner record before joining each
generation (:func:`reason`) and exits with ``EXIT_FENCED`` (:func:`leave`).
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import torch.distributed as dist

from recovery.common.events import Event
from recovery.generation import protocol, world
from replication import contract


def reason(store: dist.Store, slot: int, local_world_size: int, node: int) -> str | None:
    """Why the process of launch rank ``slot`` on ``node`` no longer owns its rank, or
    None while it does."""
    group = slot // max(1, local_world_size)
    owner = protocol.group_owner(store, group)
    if owner is None or owner == node:
        return None
    if owner == world.RETIRED:
        return (f"node {node} was declared lost and the job shrank without its ranks; "
                f"launch rank {slot} (pid {os.getpid()}) leaves the job")
    return (f"node {node} was declared lost and node {owner} took its ranks over; "
            f"rank {slot} (pid {os.getpid()}) leaves the job")


def leave(log: protocol.EventLog, rank: int, gen: int, why: str) -> NoReturn:
    """Exit at once with EXIT_FENCED: the job goes on without this process, and tearing
    down its groups could only wait on peers that left them."""
    log.emit(Event.FENCED, rank=rank, gen=gen, reason=why)
    print(f"checkpointless: {why}", file=sys.stderr, flush=True)
    os._exit(contract.EXIT_FENCED)
