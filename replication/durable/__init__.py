"""The durable tier: snapshots persisted in the background as DCP checkpoints via fsspec.

Writing (one :class:`DurableWriter` per rank)::

    writer = DurableWriter(cfg.persistence, rank, world_size, run_id=job_id)
    ...
    if writer.should_persist(meta.step):          # after the step is committed
        ticket = writer.submit(meta, slot.buffer)  # returns at once
    ...
    ticket.wait_released()   # before that snapshot slot is overwritten (normally instant)
    writer.close()

Reading::

    list_checkpoints(url)            # valid checkpoints, oldest first
    latest_checkpoint(url)           # newest valid one, or None
    find_roots(url)                  # url, or its subdirectories holding checkpoints
    newest_checkpoint([url, ...])    # newest valid one across roots (by manifest time)
    load(url_or_ckpt, state, rank=r) # verified, into live objects
    load_latest(url, state, rank=r)  # newest that verifies; falls back and says so
    verify(ckpt)                     # re-hash every file -> VerifyReport
    prune(url, keep_last)            # retention and cleanup of incomplete leftovers

The format is described in :mod:`replication.durable.format` and
``docs/adr/0005-durable-format.md``.
"""

from replication.durable.catalog import (
    CheckpointInfo,
    PruneReport,
    VerifyReport,
    find_roots,
    latest_checkpoint,
    list_checkpoints,
    newest_checkpoint,
    open_checkpoint,
    prune,
    scan,
    verify,
)
from replication.durable.format import CorruptCheckpoint, DurableError
from replication.durable.history import read_history
from replication.durable.loader import LoadResult, load, load_latest, read_snapshot
from replication.durable.saver import SaveResult
from replication.durable.ticket import PersistTicket
from replication.durable.writer import DurableWriter

__all__ = [
    "CheckpointInfo",
    "CorruptCheckpoint",
    "DurableError",
    "DurableWriter",
    "LoadResult",
    "PersistTicket",
    "PruneReport",
    "SaveResult",
    "VerifyReport",
    "find_roots",
    "latest_checkpoint",
    "list_checkpoints",
    "load",
    "load_latest",
    "newest_checkpoint",
    "open_checkpoint",
    "prune",
    "read_history",
    "read_snapshot",
    "scan",
    "verify",
]
