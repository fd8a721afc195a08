"""A generation's rendezvous: every rank joins, one rank plans, everyone adopts its plan.

Each rank (survivor or replacement) publishes a sealed :class:`JoinRecord` for the new
generation (which of its own snapshots it holds and which replicas it keeps for
others) and counts itself in with ``store.add`` on the generation's join counter. The
rank whose add reaches the world size is the *planner*: no fixed rank, so the rendezvous
does not depend on rank 0 (or any rank) having survived. The planner reads the N
records once, reads the committed step, computes the plan (:func:`choose_plan`: the
target is the newest committed step, whether the store's record or a join record says
so; ranks that hold their own snapshot of it roll back locally; every other rank
receives its state from the lowest-ranked survivor holding a replica of it; if some
state has no copy left, the reason says exactly whose and why)
and publishes it as ONE sealed record, ``cl/g{G}/plan``, with a compare-and-set
(:func:`recovery.job_store.auth.claim`). Every other rank waits for that one key: the runtime's
ranks block in the store on it (``blocking=True``: one request, answered when the key is
written; a declarer of a newer generation writes ``{"superseded_by": G+1}`` there, so
nobody stays blocked on a generation that will never be planned), and fall back to
polling it only at the deadline. All ranks therefore
act on the same bytes: they agree by construction, not because N ranks happened to
compute the same function of N reads.

Cost per recovery, in store requests and keys named, N ranks: measured with
``tests/test_rendezvous_scale.py``'s counting store on a real TCPStore (one thread and
one client per rank, each also running the runtime's generation and fencing checks;
"keys" counts every key a request names, so a ``check`` of N keys counts N). "Together":
every rank joins at once; "one late": one newcomer joins 0.5 s after the others (a warm
spare), so everyone else polls meanwhile.

=================  =========================  =========================
N, case            before: requests / keys    now: requests / keys
=================  =========================  =========================
16, together       171 / 876                  144 / 172
16, one late       3,022 / 17,512             743 / 771
64, together       699 / 12,732               591 / 715
64, one late       12,102 / 258,306           3,091 / 3,215
=================  =========================  =========================

Per rank that is 55 / 199 keys (together) and 1,094 / 4,036 keys (one late) before, at
N=16 / 64, against 11 and 48-50 keys now at both sizes.

The table measures the polling mode. With ``blocking=True`` (what the runtime uses) a
waiting rank names at most 6 keys however long it waits (``tests/test_rendezvous_scale.py``).

Before, every rank's every poll checked all N join keys and every rank finally read all
N records: O(N) keys per rank per poll, O(N^2) per recovery. Polling, a rank makes 2 writes
(its record, the counter) and polls one key with a backoff (2 ms growing to 50 ms), plus
a generation check at most every 20 ms and a fencing check at most every 100 ms; only
the planner reads N keys, twice (one ``check``, one ``multi_get`` of the N-1 records it
does not hold), then the committed step and one compare-and-set. So a recovery costs
N * (4 + 3 * polls(T)) + 2N keys in all, where polls(T) grows with how long the
rendezvous waits (a booting replacement makes everyone wait), never with N.

Failures around the planner (``docs/adr/0024-planner-rendezvous.md``):

- records that are forged or missing when the planner reads them (a forger bumped the
  counter early, a record was clobbered) are re-read, and only those, until valid
  ones are there: a forged counter delays the plan, it never changes it;
- a planner that dies (or hangs) before publishing: its agent declares a new
  generation, which ends this rendezvous for everyone (:class:`GenerationChanged`).
  Before that, a rank that sees the counter complete for :data:`TAKEOVER_S` with no
  plan takes a ticket, and the first :data:`MAX_TAKEOVERS` tickets plan too. They
  publish through the same compare-and-set, so there is still one plan;
- a waiter whose deadline passes reads the N records once to name the missing ranks
  (:func:`missing_rank`: it waits on for a process on its way, else
  :class:`RecoveryImpossible`); if nobody is missing after all, it plans itself;
- a rank that joins after the plan was published (a join counted past N) finds it at
  its first poll.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from recovery.common.errors import Fenced, RecoveryImpossible
from recovery.generation import live_plan, protocol
from recovery.generation.protocol import (
    JoinRecord,
    join_count_key,
    join_key,
    plan_key,
    plan_takeover_key,
)
from recovery.job_store import auth
from replication.errors import CheckpointlessError


class GenerationChanged(CheckpointlessError, RuntimeError):
    """Another failure started a newer generation while this one was forming."""


@dataclass(frozen=True)
class RecoveryPlan:
    """What every rank does to reach the generation's target step."""

    gen: int
    target_step: int
    providers: dict[int, int]  # rank that needs its state -> rank that sends it
    planner: int = -1  # the rank that published it (-1: not from a rendezvous)
    # A live rollback (recovery.generation.live_plan, ADR 0039): every rank goes on from the live
    # step ``target_step``; ``base_step`` is the committed step whose copies stay.
    live: bool = False
    base_step: int = -1
    # A sharded job's live rollback (ADR 0049): each newcomer rebuilds its state from
    # its replica of ``base_step`` and the update log since; else why none was possible.
    logged: bool = False
    live_refused: str = dataclasses.field(default="", compare=False)  # diagnostic only

    @property
    def newcomers(self) -> list[int]:
        return sorted(self.providers)


FRESH_START = -1
"""The target of a plan whose ranks all start from their script's initial state (see
:func:`choose_plan`)."""

FAST_POLL_S = 0.002
"""The first wait between two polls of the plan; each next one is :data:`POLL_GROWTH`
times longer, up to :data:`SLOW_POLL_S` (reached after about 0.25 s)."""
POLL_GROWTH = 1.2
SLOW_POLL_S = 0.05
"""A rendezvous that waits for a process to boot or a node to take over lasts seconds;
polling faster then only loads the store's serving thread, which every agent's heartbeat
shares. A recovery with a warm spare completes while polls are still fast."""
GEN_CHECK_S = 0.02
"""How often a waiting rank asks ``current_gen()`` for a newer generation (the runtime
answers from its watchdog's view, without a store request)."""
FENCE_CHECK_S = 0.5
"""How often a waiting rank checks that it still owns its rank (``fenced``: one or two
store reads). A node taken over also declares a new generation, which ends the wait at
once; this check is the backstop, so it need not load the store at every poll."""
REPAIR_CHECK_S = 1.0
"""How often a waiting rank checks that its own join record is still there and intact."""
TAKEOVER_S = 2.0
"""How long the join counter must have said "everyone joined", with no plan published,
before a waiting rank takes a ticket to plan in the planner's place (it reads the
counter once per this interval)."""
MAX_TAKEOVERS = 2
"""Tickets that lead to planning: the takeover costs at most this many N-key reads."""


def agree(
    store: dist.Store,
    gen: int,
    record: JoinRecord,
    world_size: int,
    timeout_s: float,
    current_gen: Callable[[], int],
    committed_step: Callable[[], int],
    fenced: Callable[[], str | None] = lambda: None,
    *,
    takeover_s: float = TAKEOVER_S,
    blocking: bool = False,
) -> tuple[RecoveryPlan, str | None]:
    """Join ``gen`` with ``record`` and return the generation's plan, and the reason the
    plan is impossible (then its target is -1) or None. Every rank gets the same pair.

    ``committed_step()`` is called by the planner only; a :class:`RecoveryImpossible` it
    raises (an untrusted commit record) becomes the plan's impossible reason, so every
    rank reaches the same verdict, as for a plan that finds some state with no copy.

    Only validly sealed records count (:mod:`recovery.job_store.auth`): a forged one reads as "not
    joined yet", a rank whose own record was overwritten or deleted writes it again
    (checked every :data:`REPAIR_CHECK_S`), and a record once verified is kept. A forged
    plan record reads as "no plan yet"; a planner replaces it.

    ``fenced()`` returns a reason when this process no longer owns its rank (its node
    was taken over); it is checked before publishing and every :data:`FENCE_CHECK_S`
    while waiting, and raises :class:`Fenced`, so a stale process never stands in for
    its replacement. A newer generation raises :class:`GenerationChanged`.

    ``blocking``: ``store`` is this rank's own connection while it waits, so a
    non-planner blocks in the store for the plan (:meth:`_Rendezvous.block_for_plan`:
    one request instead of a poll every few milliseconds) before falling back to polling.
    """
    if (why := fenced()) is not None:
        raise Fenced(why)
    sealed, count = publish_join(store, gen, record)
    rdzv = _Rendezvous(store, gen, record, sealed, world_size, timeout_s, current_gen, fenced)
    if count == world_size:
        return rdzv.plan(committed_step)
    if blocking and (found := rdzv.block_for_plan()) is not None:
        return found
    return rdzv.await_plan(committed_step, takeover_s)


def publish_join(store: dist.Store, gen: int, record: JoinRecord) -> tuple[bytes, int]:
    """Seal and publish ``record`` as its rank's join record for ``gen``, then count it.

    Returns the sealed bytes (a process puts them back if someone clobbers them) and the
    join count after this join: the rank that brings it to the world size plans. The
    record is written before the count, on the same connection, so a planner that sees
    the count complete finds every record that was counted."""
    sealed = auth.put(store, join_key(gen, record.rank), record.to_json())
    return sealed, int(store.add(join_count_key(gen), 1))


def joined_records(store: dist.Store, gen: int, world_size: int) -> dict[int, JoinRecord]:
    """The validly sealed join records of ``gen`` so far, by rank. ``gen`` is complete
    when there are ``world_size`` of them (what a planner waits for)."""
    out: dict[int, JoinRecord] = {}
    for rank in range(world_size):
        _joined(store, join_key(gen, rank), out, rank)
    return out


def published_plan(store: dist.Store, gen: int) -> tuple[RecoveryPlan, str | None] | None:
    """``gen``'s plan and impossible reason if a validly sealed plan is published."""
    key = plan_key(gen)
    payload = auth.open_value(key, auth.read_raw(store, key))
    return None if payload is None else _parse_plan(payload, gen)


def _parse_plan(payload: str, gen: int) -> tuple[RecoveryPlan, str | None] | None:
    try:
        d = json.loads(payload)
        if isinstance(d, dict) and protocol.SUPERSEDED in d:
            raise GenerationChanged(
                f"generation {gen} superseded by {int(d[protocol.SUPERSEDED])}")
        plan = RecoveryPlan(int(d["gen"]), int(d["target_step"]),
                            {int(k): int(v) for k, v in d["providers"].items()},
                            int(d["planner"]), bool(d.get("live", False)),
                            int(d.get("base_step", -1)), bool(d.get("logged", False)),
                            str(d.get("live_refused", "")))
        impossible = None if d.get("impossible") is None else str(d["impossible"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None  # sealed with our key yet unreadable: a bug elsewhere; nobody acts on it
    return (plan, impossible) if plan.gen == gen else None


def _plan_payload(plan: RecoveryPlan, impossible: str | None, committed: int | None,
                  world_size: int) -> str:
    return json.dumps({
        "gen": plan.gen, "target_step": plan.target_step,
        "providers": {str(k): v for k, v in sorted(plan.providers.items())},
        "impossible": impossible, "planner": plan.planner, "committed_step": committed,
        "live": plan.live, "base_step": plan.base_step, "logged": plan.logged,
        "live_refused": plan.live_refused, "world_size": world_size, "ts": time.time(),
    })


class _Rendezvous:
    """One rank's side of one generation's rendezvous after it joined: waiting (with a
    backoff and the periodic checks), planning, and the diagnosis at the deadline."""

    def __init__(self, store: dist.Store, gen: int, record: JoinRecord, sealed: bytes,
                 world_size: int, timeout_s: float, current_gen: Callable[[], int],
                 fenced: Callable[[], str | None]) -> None:
        self.store, self.gen, self.rank = store, gen, record.rank
        self.sealed, self.world_size, self.timeout_s = sealed, world_size, timeout_s
        self.current_gen, self.fenced = current_gen, fenced
        self.seen: dict[int, JoinRecord] = {record.rank: record}  # verified: kept
        now = time.monotonic()
        self.deadline = now + timeout_s
        self.extensions = 0
        self.delay = FAST_POLL_S
        self._next_gen = now
        self._next_fence = now + FENCE_CHECK_S  # checked just before publishing
        self._next_repair = now + REPAIR_CHECK_S

    # -- waiting ------------------------------------------------------------------------
    def block_for_plan(self) -> tuple[RecoveryPlan, str | None] | None:
        """Wait in the store for the plan key, until the deadline: one request, answered
        the moment the planner (or, for a superseded generation, the next declarer)
        writes it. None: no valid plan by then (the deadline's diagnosis, or a forged
        value in the key), and the caller polls as before.

        No fencing, repair or takeover checks run meanwhile; each case ends the wait
        another way: a node taken over and a planner that dies or hangs both lead to a
        new generation, whose declarer writes this key. A forger who clobbers this
        rank's record while it waits delays the plan to the deadline (denial of
        service, out of scope: ``docs/security.md``).
        """
        left = self.deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            self.store.wait([plan_key(self.gen)], datetime.timedelta(seconds=left))
        except (dist.DistStoreError, TimeoutError, RuntimeError):
            return None  # the deadline: the polling path names the missing ranks
        return published_plan(self.store, self.gen)

    def await_plan(self, committed_step: Callable[[], int],
                   takeover_s: float) -> tuple[RecoveryPlan, str | None]:
        """Poll the plan key until the planner publishes; take over if it stays silent."""
        next_count = time.monotonic() + takeover_s
        full_since: float | None = None
        ticket_taken = False
        while True:
            if (found := published_plan(self.store, self.gen)) is not None:
                return found
            self.pause()
            now = time.monotonic()
            if not ticket_taken and now >= next_count:
                next_count = now + takeover_s
                if int(self.store.add(join_count_key(self.gen), 0)) >= self.world_size:
                    if full_since is None:
                        full_since = now
                    elif now - full_since >= takeover_s:
                        ticket_taken = True
                        ticket = int(self.store.add(plan_takeover_key(self.gen), 1))
                        if ticket <= MAX_TAKEOVERS:
                            return self.plan(committed_step)
            if now > self.deadline and self._expired():
                return self.plan(committed_step)  # everyone joined, yet no plan: plan

    def pause(self) -> None:
        """Sleep one backoff step, then run the checks that are due: a newer generation,
        fencing, this rank's own record."""
        time.sleep(self.delay)
        self.delay = min(SLOW_POLL_S, self.delay * POLL_GROWTH)
        now = time.monotonic()
        if now >= self._next_fence:
            self._next_fence = now + FENCE_CHECK_S
            if (why := self.fenced()) is not None:
                raise Fenced(why)
        if now >= self._next_gen:
            self._next_gen = now + GEN_CHECK_S
            if (newer := self.current_gen()) != self.gen:
                raise GenerationChanged(f"generation {self.gen} superseded by {newer}")
        if now >= self._next_repair:
            self._next_repair = now + REPAIR_CHECK_S
            self._repair()

    def _repair(self) -> None:
        """Put this rank's record back if it was deleted or overwritten by a forger (a
        validly sealed record of another process of this rank is left alone)."""
        key = join_key(self.gen, self.rank)
        raw = auth.read_raw(self.store, key)
        if raw is None or (bytes(raw) != self.sealed and auth.open_value(key, raw) is None):
            self.store.set(key, self.sealed)

    # -- planning -----------------------------------------------------------------------
    def plan(self, committed_step: Callable[[], int]) -> tuple[RecoveryPlan, str | None]:
        """Read the records not verified yet (only those, again and again, until all are
        valid), compute the plan and publish it; or adopt a plan already published."""
        while self._read(self._missing(), each=False):
            if (found := published_plan(self.store, self.gen)) is not None:
                return found  # another planner was first
            self.pause()
            if time.monotonic() > self.deadline and self._expired():
                break
        committed: int | None = None
        try:
            committed = committed_step()
            plan = choose_plan(self.gen, committed, self.seen)
            plan, impossible = dataclasses.replace(plan, gen=self.gen, planner=self.rank), None
        except RecoveryImpossible as exc:  # every rank gets the same verdict, from here
            plan, impossible = RecoveryPlan(self.gen, -1, {}, self.rank), str(exc)
        payload = _plan_payload(plan, impossible, committed, self.world_size)
        won, agreed = auth.claim(self.store, plan_key(self.gen), payload)
        if won:
            return plan, impossible
        # A concurrent planner won the compare-and-set: its plan, whatever ours says.
        if (theirs := _parse_plan(agreed, self.gen)) is None:
            raise RuntimeError(f"generation {self.gen}'s plan record is unreadable: {agreed!r}")
        return theirs

    def _missing(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.seen]

    def _read(self, ranks: list[int], each: bool) -> list[int]:
        """Read the records of ``ranks`` (one ``check`` and one ``multi_get`` when all
        exist; with ``each``, key by key when some do not) and keep the valid ones;
        returns the ranks still without a valid record."""
        if not ranks:
            return []
        keys = [join_key(self.gen, r) for r in ranks]
        if self.store.check(keys):
            for r, key, raw in zip(ranks, keys, self.store.multi_get(keys)):
                if (payload := auth.open_value(key, raw)) is not None:
                    self.seen[r] = JoinRecord.from_json(payload)
        elif each:
            for r, key in zip(ranks, keys):
                _joined(self.store, key, self.seen, r)
        return [r for r in ranks if r not in self.seen]

    # -- the deadline -------------------------------------------------------------------
    def _expired(self) -> bool:
        """The deadline passed: read the records still missing, once. True if none is
        (the caller plans); waits on (False, a new deadline) while a missing rank's
        process is on its way; else :class:`RecoveryImpossible` naming each one."""
        missing = self._read(self._missing(), each=True)
        if not missing:
            return True
        seen_of = {r: missing_rank(self.store, r) for r in missing}
        if any(m.on_its_way for m in seen_of.values()):
            # A live process is on its way (a replacement still starting, a survivor
            # still leaving a collective): never give up on it. Its agent kills it if it
            # hangs once armed, which ends this wait; until then, say why we wait, once
            # per timeout, so a long wait is never a silent one.
            self.extensions += 1
            self.deadline = time.monotonic() + self.timeout_s
            print(f"checkpointless: generation {self.gen}: still waiting for ranks {missing} "
                  f"after {self.timeout_s * self.extensions:.0f}s: "
                  + "; ".join(m.describe() for m in seen_of.values()),
                  file=sys.stderr, flush=True)
            return False
        waited = self.timeout_s * (1 + self.extensions)
        raise RecoveryImpossible(
            f"generation {self.gen}: ranks {missing} did not rejoin within {waited:.0f}s: "
            + "; ".join(m.describe() for m in seen_of.values()))


def finished_while_training(store: dist.Store, gen: int, slots: Sequence[int]) -> str | None:
    """The line that stops a job whose ranks finished training while others still
    train (generation ``gen`` is being recovered); None when no rank has finished.
    ``slots``: the launch ranks of the world (the "trained" records are keyed by them).

    A rank that finished never joins a rendezvous again, so waiting for it only delays
    this line by the rendezvous timeout (it used to say "is a spare available?"). The
    usual cause is a loop that counts steps itself: after a recovery its counter goes on
    from where it was, so ranks run different numbers of steps. One read when nobody has
    finished (the "any done" record), a read per rank otherwise."""
    if not protocol.any_done(store):
        return None
    trained = {r: auth.read(store, protocol.trained_key(r)) for r in slots}
    finished = {r: step for r, step in trained.items() if step is not None}
    training = sorted(r for r, step in trained.items() if step is None)
    if not finished or not training:
        return None
    done = ", ".join(f"rank {r} at step {step}" for r, step in sorted(finished.items()))
    return (f"generation {gen}: {done} finished training (last step committed, process "
            f"exited) while ranks {training} still train: the ranks ran different "
            "numbers of steps. A loop that counts steps itself (`for _ in range(n):`) "
            "does not go back with a recovery; use `for i in cl.steps(n):` or iterate "
            "the loader (`for batch in loader:`)")


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


def choose_plan(gen: int, recorded: int, records: dict[int, JoinRecord]) -> RecoveryPlan:
    """The plan for the newest committed step every state still has a copy of.

    Two sources say which steps are committed: the store's sealed record (``recorded``)
    and each rank's join record (the newest step its commit agreement returned for). Rank
    0 writes the store's record off the training path (ADR 0022, addendum 2), so it may
    lag by a step or more, and while the store has no quorum by many: a rank may then
    already have dropped the recorded step's slot for a newer committed one. A step any
    rank learned is committed had every copy when it was (that is what the agreement
    vouched for), and no rank overwrites a slot before its own round for the step
    ended, so the newest such step is the target; an older candidate is tried only if a
    copy of the newer one died with its holder. Join records report the commits of the
    current timeline (a rollback resets them); a store record newer than all of them is
    not trusted, since a round abandoned before a rollback may have written it late
    (when rank 0 recorded a step and died before anyone learned it, the step before is
    as good a target: every rank still holds it). Records that report nothing (every
    rank a newcomer, or a caller without that knowledge) leave the store's record alone.
    """
    known = {r.committed for r in records.values()}
    trusted = recorded <= max(known) or max(known) < 0  # no rank knows: as before
    candidates = sorted(known | ({recorded} if trusted else set()), reverse=True)
    if candidates[0] < 0 and all(r.newcomer and not r.local_steps and not r.replicas
                                 for r in records.values()):
        # Nothing was ever committed and every process is new (one was killed in the
        # script's set-up, before the first step): all of them start the job afresh,
        # as the first generation did, rather than stop it.
        return RecoveryPlan(gen, FRESH_START, {})
    first_error: RecoveryImpossible | None = None
    for step in candidates:
        try:
            plan = make_plan(gen, step, records)
        except RecoveryImpossible as exc:
            first_error = first_error or exc
            continue
        return live_plan.upgrade(plan, records)  # no replay where it can
    assert first_error is not None
    raise first_error


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
    return RecoveryPlan(gen, target_step, providers)
