"""A generation's rendezvous and the recovery plan every rank derives from it.

Each rank (survivor or replacement) publishes a :class:`JoinRecord` for the new
generation: which of its own snapshots it holds and which replicas it keeps for
others. Once all ranks have joined, every rank computes the same plan from the same
records: the target is the newest committed step; ranks that hold their own snapshot
of it roll back locally; every other rank receives its state from the lowest-ranked
survivor holding a replica of it. If some rank's state has no copy left, the plan says
exactly whose and why.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from recovery import auth, protocol
from recovery.errors import Fenced, RecoveryImpossible
from recovery.protocol import JoinRecord, join_key
from replication.errors import CheckpointlessError


class GenerationChanged(CheckpointlessError, RuntimeError):
    """Another failure started a newer generation while this one was forming."""


@dataclass(frozen=True)
class RecoveryPlan:
    gen: int
    target_step: int
    records: dict[int, JoinRecord]
    providers: dict[int, int]  # rank that needs its state -> rank that sends it

    @property
    def newcomers(self) -> list[int]:
        return sorted(self.providers)


FAST_POLLS = 60
"""Polls made every 5 ms before :func:`join` slows to one every 50 ms (about 0.3 s)."""


def join(
    store: dist.Store,
    gen: int,
    record: JoinRecord,
    world_size: int,
    timeout_s: float,
    current_gen: Callable[[], int],
    fenced: Callable[[], str | None] = lambda: None,
) -> dict[int, JoinRecord]:
    """Publish ``record`` (sealed) for ``gen`` and wait until every rank has joined.

    Only validly sealed records count (:mod:`recovery.auth`): a forged one reads as "not
    joined yet", a rank whose own record was overwritten or deleted writes it again, and
    a record once verified is kept, so clobbering it afterwards changes nothing.

    ``fenced()`` returns a reason when this process no longer owns its rank (its node
    was taken over); it is checked before publishing and every 50-100 ms while waiting,
    and raises :class:`Fenced`, so a stale process never stands in for its replacement.

    It polls every 5 ms for the first :data:`FAST_POLLS` polls (a recovery with a warm
    spare completes within them) and every 50 ms after that. A rendezvous that waits for
    a process to boot or a node to take over lasts seconds, and at 5 ms each waiting
    rank sends the store's one serving thread several hundred requests a second, load
    that competes with every agent's heartbeat on a busy host.
    """
    if (why := fenced()) is not None:
        raise Fenced(why)
    own = join_key(gen, record.rank)
    sealed = publish_join(store, gen, record)
    keys = [join_key(gen, r) for r in range(world_size)]
    seen: dict[int, JoinRecord] = {record.rank: record}
    deadline = time.monotonic() + timeout_s
    extensions = 0
    for polls in itertools.count(1):
        if (polls % 20 == 0 or polls > FAST_POLLS) and (why := fenced()) is not None:
            raise Fenced(why)
        if store.check(keys):
            for r, (key, raw) in enumerate(zip(keys, store.multi_get(keys))):
                if r == record.rank:
                    if bytes(raw) != sealed and auth.open_value(key, raw) is None:
                        store.set(own, sealed)  # a forger overwrote it: put it back
                elif r not in seen and (payload := auth.open_value(key, raw)) is not None:
                    seen[r] = JoinRecord.from_json(payload)
            if len(seen) == world_size:
                return dict(sorted(seen.items()))
        elif not store.check([own]):
            store.set(own, sealed)  # deleted by someone: put it back
        if current_gen() != gen:
            raise GenerationChanged(f"generation {gen} superseded by {current_gen()}")
        if time.monotonic() > deadline:
            missing = [r for r in range(world_size) if r not in seen
                       and not _joined(store, keys[r], seen, r)]
            if not missing:
                return dict(sorted(seen.items()))
            seen_of = {r: missing_rank(store, r) for r in missing}
            if any(m.on_its_way for m in seen_of.values()):
                # A live process is on its way (a replacement still starting, a survivor
                # still leaving a collective): never give up on it. Its agent kills it
                # if it hangs once armed, which ends this wait; until then, say why we
                # wait, once per timeout, so a long wait is never a silent one.
                extensions += 1
                deadline = time.monotonic() + timeout_s
                print(f"checkpointless: generation {gen}: still waiting for ranks {missing} "
                      f"after {timeout_s * extensions:.0f}s: "
                      + "; ".join(m.describe() for m in seen_of.values()),
                      file=sys.stderr, flush=True)
                continue
            waited = timeout_s * (1 + extensions)
            raise RecoveryImpossible(
                f"generation {gen}: ranks {missing} did not rejoin within {waited:.0f}s: "
                + "; ".join(m.describe() for m in seen_of.values()))
        time.sleep(0.005 if polls < FAST_POLLS else 0.05)


def publish_join(store: dist.Store, gen: int, record: JoinRecord) -> bytes:
    """Seal and publish ``record`` as its rank's join record for ``gen``; returns the
    sealed bytes (a process puts them back if someone clobbers them)."""
    return auth.put(store, join_key(gen, record.rank), record.to_json())


def joined_records(store: dist.Store, gen: int, world_size: int) -> dict[int, JoinRecord]:
    """The validly sealed join records of ``gen`` so far, by rank. ``gen`` is complete
    when there are ``world_size`` of them (what :func:`join` waits for)."""
    out: dict[int, JoinRecord] = {}
    for rank in range(world_size):
        _joined(store, join_key(gen, rank), out, rank)
    return out


AGENT_BEAT_WAIT_S = 3.0
"""How long a rendezvous watches an agent's heartbeat counter to tell it is alive."""


@dataclass(frozen=True)
class MissingRank:
    """What the store shows about a rank that has not joined a generation."""

    rank: int
    process: dict[str, Any] | None  # the agent's record (protocol.publish_rank_process)
    agent_alive: bool | None  # its agent's heartbeat moved while we watched

    @property
    def on_its_way(self) -> bool:
        p = self.process
        return bool(p and p.get("state") == "running" and self.agent_alive)

    def describe(self) -> str:
        p = self.process
        if p is None:
            return (f"rank {self.rank}: no process was ever recorded for it (no agent "
                    "started one)")
        where = f"pid {p.get('pid')} on node {p.get('node')}"
        ago = f"{max(0.0, time.time() - float(p.get('ts', time.time()))):.1f}s ago"
        if p.get("state") == "exited":
            how = p.get("signal") or f"code {p.get('exitcode')}"
            return (f"rank {self.rank}: its process ({where}) exited with {how} {ago} and "
                    "no replacement was started (is a spare node or spare worker "
                    "available?)")
        if not self.agent_alive:
            return (f"rank {self.rank}: its process ({where}, started {ago}) is on a node "
                    f"whose agent sent no heartbeat for {AGENT_BEAT_WAIT_S:.0f}s (node lost?)")
        return (f"rank {self.rank}: its process ({where}, started {ago}) is alive but "
                "never joined (stuck in the script before the runtime joins?)")


def missing_rank(store: dist.Store, rank: int) -> MissingRank:
    """Read what the store shows about ``rank``; watches its agent's heartbeat briefly."""
    try:
        process = protocol.read_json(store, protocol.rank_process_key(rank))
    except Exception:
        process = None
    alive = None
    if process is not None and process.get("node") is not None:
        node = int(process["node"])
        first = protocol.agent_beats(store, node)
        until = time.monotonic() + AGENT_BEAT_WAIT_S
        alive = False
        while time.monotonic() < until:
            now = protocol.agent_beats(store, node)
            if first is not None and now is not None and now > first:
                alive = True
                break
            time.sleep(0.1)
    return MissingRank(rank, process, alive)


def _joined(store: dist.Store, key: str, seen: dict[int, JoinRecord], rank: int) -> bool:
    payload = auth.read(store, key)
    if payload is not None:
        seen[rank] = JoinRecord.from_json(payload)
    return payload is not None


def make_plan(gen: int, target_step: int, records: dict[int, JoinRecord]) -> RecoveryPlan:
    """Decide who rolls back locally and who receives state from whom."""
    if target_step < 0:
        raise RecoveryImpossible(
            "a failure happened before the first step was committed; there is no "
            "in-memory state to recover to"
        )
    providers: dict[int, int] = {}
    lost: list[str] = []
    for rank, rec in sorted(records.items()):
        if target_step in rec.local_steps:
            continue
        holders = sorted(
            r for r, other in records.items()
            if r != rank and target_step in other.replicas.get(str(rank), [])
        )
        if holders:
            providers[rank] = holders[0]
        else:
            lost.append(f"rank {rank} (now on node {rec.node})")
    if lost:
        raise RecoveryImpossible(
            f"the state of {', '.join(lost)} at committed step {target_step} has no surviving "
            "copy: its own snapshot died with its process and no live rank holds a replica "
            "of it (every holder failed too, or replication.factor=1)"
        )
    return RecoveryPlan(gen, target_step, records, providers)
