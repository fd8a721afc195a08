"""``ModelCheckpoint`` files written by steps that a recovery rolled back.

A recovery rolls every rank back to the newest committed snapshot, and the steps after
it run again, bit-identical. A ``ModelCheckpoint`` save in one of those steps already
wrote its file the first time. On the replay the callback, its own state restored to
the snapshot's, finds that file on disk and, taking it for somebody else's, saves
under a new name instead (``last-v1.ckpt``, ``epoch=0-step=4-v1.ckpt``): a run with a
failure would leave other files, and other ``best_model_path`` / ``last_model_path``
values, than the same run without one. With a snapshot every step a rollback seldom
crossed a save; with an interval (``replication.every_n_steps: auto``, the default) it
often does.

So rank 0 records in the job's store, for every file the strategy saves, the global
step it was written at (the store outlives any rank, so a replacement of rank 0 knows
too). Each ``ModelCheckpoint``'s ``file_exists`` is wrapped: a file recorded at this
step or a later one was written by a rolled-back step (in a run without failures no
file can come from a step not yet reached), so it does not count as existing and the
replay writes over it, with the same bytes. Files nobody recorded (a previous run's in
the same directory) count as before.
"""

from __future__ import annotations

import hashlib
from typing import Any

from recovery.job_store import auth

_MARK = "_checkpointless_replay_aware"


def _key(path: str) -> str:
    return "cl/saved/" + hashlib.sha256(path.encode()).hexdigest()[:32]


def record(store: Any, path: Any, step: int) -> None:
    """Rank 0, for every checkpoint file the strategy saves: written at ``step``."""
    auth.put(store, _key(str(path)), str(step))


def saved_at(store: Any, path: Any) -> int | None:
    """The step ``path`` was last written at by this job, or None (never by this job)."""
    payload = auth.read(store, _key(str(path)))
    return None if payload is None else int(payload)


def install(trainer: Any, store: Any) -> None:
    """Wrap every ``ModelCheckpoint``'s ``file_exists`` of ``trainer`` (once per
    callback object: a recovery re-enters ``fit`` with the same callbacks). Every rank
    wraps: the answer is agreed with a collective, as Lightning's own is."""
    for cb in getattr(trainer, "checkpoint_callbacks", []):
        if getattr(cb, _MARK, False) or not hasattr(cb, "file_exists"):
            continue
        _wrap(cb, store)


def _wrap(cb: Any, store: Any) -> None:
    exists = cb.file_exists

    def file_exists(filepath: Any, trainer: Any) -> bool:
        found = exists(filepath, trainer)  # Lightning's own check, agreed across ranks
        if not found:
            return False
        stale = False
        if trainer.is_global_zero:
            at = saved_at(store, filepath)
            stale = at is not None and at >= trainer.global_step
        return not trainer.strategy.reduce_boolean_decision(stale, all=False)

    cb.file_exists = file_exists
    setattr(cb, _MARK, True)
