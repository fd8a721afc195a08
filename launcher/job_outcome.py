"""What the agent's last line says about the job's result: the newest committed step
and what reached durable storage.

Both are read back at the end, from the store and from storage, rather than taken from
the workers' word: a forged commit record shows as "unverified", and the durable
outcome lists ``persistence.path`` itself. A run that asked for persistence and has no
complete checkpoint there exits 1 (:meth:`launcher.agent.Agent._done` decides; this
module only finds out). Kept apart from the agent's loop, which never needs any of it.
"""

from __future__ import annotations

import posixpath
from datetime import datetime

import torch.distributed as dist

from recovery.common.causes import FailureCause
from replication import contract
from replication.config import PersistenceConfig
from replication.replica_protocol.commit import UntrustedCommit
from replication.replica_protocol.commit import committed_step as _committed_step


def exit_status(failure: dict) -> int:
    """The agent's exit status for the job's fatal record: the script's own error is
    never worth a retry; anything else (a state lost with every copy, no spare node,
    the restart budget spent, a node stopped) may go on in a new allocation."""
    if failure.get("kind") == FailureCause.USER_ERROR:
        return contract.EXIT_SCRIPT_ERROR
    return contract.EXIT_RETRY


def meaning(code: int) -> str:
    """What the exit status tells a scheduler, for the "job failed" line."""
    if code == contract.EXIT_SCRIPT_ERROR:
        return f" (exit {code}: the script's own error, a retry fails the same way)"
    if code == contract.EXIT_RETRY:
        return (f" (exit {code}: a new run can go on, from the newest durable checkpoint "
                "where persistence.path is set)")
    return ""


def committed_step(store: dist.Store) -> int | str | None:
    """The newest committed step, for the agent's report ("unverified" if forged)."""
    try:
        step = _committed_step(store)
    except UntrustedCommit:
        return "unverified"
    return None if step < 0 else step


def durable_outcome(p: PersistenceConfig, started_at: float) -> tuple[str, bool | None]:
    """For the last line: the newest complete checkpoint at ``persistence.path``
    (read back from storage, not taken from the writers' word), and whether a run
    that asked for persistence got any: ``None`` when storage cannot be read to tell
    (a job that ends during a storage outage). A run that persisted nothing, or cannot
    show that it persisted anything, exits 1.

    ``started_at``: this run's start (``time.time()``); only its saves are counted."""
    if not p.path:
        return "", True
    from replication.durable import DurableError, scan

    opts = dict(p.storage_options)
    valid: list = []
    try:
        valid = [c for c in scan(p.path, opts) if c.valid]
        problem = None if _is_dir(p.path, opts) else f"{p.path} is not a directory"
    except (DurableError, OSError) as exc:
        problem = str(exc)
    if problem is not None and not _missing(p.path, opts):
        return f", durable: cannot list {p.path!r} ({problem})", None
    newest = valid[-1] if valid else None
    saves = _durable_saves(p.path, opts, started_at)
    if newest is None:
        return f", durable: nothing persisted{saves}", False
    return f", durable: newest complete checkpoint step {newest.step}{saves}", True


def _is_dir(url: str, options: dict) -> bool:
    """Whether ``url`` is a directory (or, on an object store, a prefix); a path that
    points at a file (a storage outage in the chaos soak: the link re-pointed) is not."""
    from replication.durable.storage import resolve

    fs, path = resolve(url, options)
    return not fs.exists(path) or fs.isdir(path)


def _missing(url: str, options: dict) -> bool:
    """Whether ``url`` plainly does not exist (its parent can be read and lacks it), as
    opposed to storage that cannot be read now (an outage: a path component that is no
    directory, a bucket that does not answer)."""
    from replication.durable.storage import resolve

    try:
        fs, path = resolve(url, options)
        return not fs.exists(path) and fs.isdir(posixpath.dirname(path.rstrip("/")))
    except Exception:  # cannot tell: not "missing"
        return False


def _durable_saves(url: str, options: dict, started_at: float) -> str:
    """This run's saves by outcome, from the checkpoint history on storage (each
    rank appends a row per save), e.g. " (38 rank saves: 36 ok, 2 failed)"."""
    from replication.durable import read_history

    def when(row: dict[str, str]) -> float:  # ISO 8601 with a Z
        return datetime.fromisoformat(row["timestamp"].replace("Z", "+00:00")).timestamp()

    try:
        rows = [r for r in read_history(url, options) if when(r) >= started_at]
    except Exception:  # the summary is a courtesy: never fail the ending on it
        return ""
    if not rows:
        return ""
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.get("status") or "?"] = counts.get(r.get("status") or "?", 0) + 1
    parts = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    return f" ({len(rows)} rank saves: {parts})"
