"""Restore every rank from the durable tier, agreeing on one checkpoint first.

Used in two situations, both announced with their reason:

* **Fallback.** A generation's rendezvous shows that some rank's state at the committed
  step has no surviving in-memory copy (its own snapshot died with it and every replica
  holder failed too, or ``replication.factor`` is 1). Instead of ending the job, every
  rank -- survivors and replacements alike -- replaces its whole state with the newest
  durable checkpoint that *every* rank can read and verify. Survivors are not
  restarted: their state is overwritten entirely from storage, which is what a restart
  would achieve, without paying for interpreter start-up and process-group formation
  again (docs/adr/0009-durable-fallback-in-process.md).
* **Resume.** A new job whose ``persistence.path`` already holds checkpoints of an
  earlier run starts from the newest valid one (``persistence.resume: auto``).

Agreement. All ranks must load the *same* step, and a checkpoint is only usable if each
rank's own files verify. Listing storage independently could give ranks different
answers (a background save may complete in between), so rank 0 publishes the candidate
steps, newest first, under the generation's prefix; then, candidate by candidate, each
rank reads and verifies its own part and posts ``ok`` or the reason it cannot. The first
candidate every rank accepts wins; the others are reported as skipped, with the reason
(a corrupted newest checkpoint thus falls back to the one before it, and says so).
Nothing live is touched until the vote is unanimous. Every record is sealed with the
job key (:mod:`recovery.job_store.auth`): a forged vote or candidate list reads as not yet written.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from recovery.common.errors import RecoveryImpossible
from recovery.generation import protocol
from recovery.generation.rendezvous import GenerationChanged
from recovery.job_store import auth
from replication.config import PersistenceConfig
from replication.training_state.snapshot_meta import SnapshotMeta

#: How long a rank waits for the others' votes on one candidate (reads can be slow).
VOTE_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class DurableChoice:
    """The checkpoint all ranks agreed on, and what was skipped on the way."""

    step: int
    url: str
    skipped: list[dict[str, object]] = field(default_factory=list)  # {"step", "reason"}
    read_s: float = 0.0


def candidates_key(gen: int) -> str:
    return f"{protocol.gen_prefix(gen)}/durable/candidates"


def vote_key(gen: int, step: int, rank: int) -> str:
    return f"{protocol.gen_prefix(gen)}/durable/{step}/{rank}"


def agree_and_read(
    store: dist.Store,
    gen: int,
    rank: int,
    world_size: int,
    persistence: PersistenceConfig,
    current_gen: Callable[[], int],
) -> tuple[DurableChoice, SnapshotMeta, torch.Tensor] | None:
    """Agree on the newest checkpoint every rank can verify; return it and this rank's
    verified snapshot (metadata and buffer, not yet applied to live objects), or
    ``None`` when storage holds no complete checkpoint at all.

    Raises :class:`RecoveryImpossible` when no checkpoint works for every rank, and
    :class:`GenerationChanged` when another failure supersedes this generation.
    """
    from replication.durable import DurableError, list_checkpoints, read_snapshot
    from replication.durable.format import step_dir

    url, opts = persistence.path, dict(persistence.storage_options)
    if rank == 0:
        listing: object
        try:
            listing = [c.step for c in reversed(list_checkpoints(url, opts))]
        except (DurableError, OSError) as exc:
            listing = {"error": f"cannot list {url!r}: {exc}"[:600]}
        auth.put(store, candidates_key(gen), json.dumps(listing))
    steps = _wait_json(store, candidates_key(gen), gen, current_gen)
    if isinstance(steps, dict):  # the lister's error
        raise RecoveryImpossible(f"durable tier: {steps['error']}")
    if not steps:
        return None
    skipped: list[dict[str, object]] = []
    t0 = time.monotonic()
    for step in steps:
        where = step_dir(url, step)
        snapshot: tuple[SnapshotMeta, torch.Tensor] | None = None
        try:
            snapshot = read_snapshot(where, rank, storage_options=opts)
            verdict = "ok"
        except (DurableError, OSError, ValueError, KeyError) as exc:
            verdict = f"rank {rank}: {type(exc).__name__}: {str(exc)[:300]}"
        auth.put(store, vote_key(gen, step, rank), verdict)
        votes = _wait_votes(store, gen, step, world_size, current_gen)
        bad = [v for v in votes if v != "ok"]
        if not bad and snapshot is not None:
            choice = DurableChoice(step, where, skipped, time.monotonic() - t0)
            return choice, snapshot[0], snapshot[1]
        skipped.append({"step": step, "reason": "; ".join(bad)[:600]})
    reasons = "; ".join(f"step {s['step']}: {s['reason']}" for s in skipped)
    raise RecoveryImpossible(f"durable tier: no checkpoint under {url!r} is readable by every "
                             f"rank ({reasons})")


def _wait_json(store: dist.Store, key: str, gen: int, current_gen: Callable[[], int]) -> object:
    """The sealed JSON under ``key`` once written (a forged value reads as not yet)."""
    deadline = time.monotonic() + VOTE_TIMEOUT_S
    while (value := auth.read(store, key)) is None:
        _check_alive(gen, current_gen, deadline, "rank 0's list of durable checkpoints")
        time.sleep(0.01)
    return json.loads(value)


def _wait_votes(
    store: dist.Store, gen: int, step: int, world_size: int, current_gen: Callable[[], int]
) -> list[str]:
    keys = [vote_key(gen, step, r) for r in range(world_size)]
    deadline = time.monotonic() + VOTE_TIMEOUT_S
    while True:
        votes = auth.read_all(store, keys)
        if votes is not None and all(v is not None for v in votes):
            return [str(v) for v in votes]
        _check_alive(gen, current_gen, deadline, f"every rank's verdict on step {step}")
        time.sleep(0.01)


def _check_alive(gen: int, current_gen: Callable[[], int], deadline: float, what: str) -> None:
    if current_gen() != gen:
        raise GenerationChanged(f"generation {gen} superseded by {current_gen()}")
    if time.monotonic() > deadline:
        raise RecoveryImpossible(f"durable tier: timed out after {VOTE_TIMEOUT_S:.0f}s "
                                 f"waiting for {what}")
