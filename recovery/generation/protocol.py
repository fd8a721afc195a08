"""The control-plane contract between agents and workers: store keys and primitives.

Everything that agents (``launcher``) and workers (``recovery``) coordinate on lives in
the job's c10d store under ``cl/``. Keeping every key in this one module makes the
protocol reviewable in one place and keeps both sides from drifting apart.

Generations. The job starts in generation 0. Any participant that detects a failure
moves the job to the next generation by recording the failure's cause under
``cl/g{G+1}/cause`` with a compare-and-set from the generation it observed, so several
detectors of the same failure produce one new generation, while a failure *during* a
recovery produces another. Every process group, commit counter and rendezvous of a
generation lives under ``cl/g{G}/``, so nothing from a dead generation can be mistaken
for a live one.

Authentication. The store itself authenticates nobody, so every record a participant
acts on is sealed with the job key (:mod:`recovery.job_store.auth`). The current generation is
therefore not a counter anyone could bump: it is the length of the chain of validly
sealed cause records ``cl/g1/cause, cl/g2/cause, ...``. Likewise the fatal flag, group
owners, join records, heartbeats, agent registrations and the "done" records are sealed,
and counters only serve as hints that are verified against sealed records.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from recovery.common.causes import CONSEQUENTIAL, FailureCause
from recovery.common.events import registered
from recovery.generation.join_record import JoinRecord
from recovery.job_store import auth
from replication.side_channel import signing

PREFIX = "cl"
FATAL_KEY = f"{PREFIX}/fatal"
DONE_PREFIX = f"{PREFIX}/done"


def gen_prefix(gen: int) -> str:
    return f"{PREFIX}/g{gen}"


def join_key(gen: int, rank: int) -> str:
    return f"{gen_prefix(gen)}/join/{rank}"


def join_count_key(gen: int) -> str:
    """Counter of the joins of ``gen`` (``store.add``, not sealed: a hint). The rank whose
    add reaches the world size plans the generation (:mod:`recovery.generation.rendezvous`)."""
    return f"{gen_prefix(gen)}/join_count"


def plan_key(gen: int) -> str:
    """The sealed recovery plan of ``gen``, written once (compare-and-set) by its planner,
    or, if a newer generation came first, ``{SUPERSEDED: newer}`` (by its declarer)."""
    return f"{gen_prefix(gen)}/plan"


#: The field of a plan record that says its generation was superseded, not planned.
SUPERSEDED = "superseded_by"


def plan_takeover_key(gen: int) -> str:
    """Counter of the ranks that took over planning ``gen`` from a silent planner."""
    return f"{gen_prefix(gen)}/plan_takeover"


#: Sealed: the newest step whose logged rows rank 0 released to its loggers, readable by
#: a replacement rank 0 on any node (``recovery.integrations.lightning.logger_gate``).
LOGGED_KEY = "cl/logged_through"


def logged_through(store: dist.Store) -> int | None:
    payload = auth.read(store, LOGGED_KEY)
    return None if payload is None else int(payload)


def mark_logged(store: dist.Store, step: int) -> None:
    auth.put(store, LOGGED_KEY, str(step))


def cause_key(gen: int) -> str:
    return f"{gen_prefix(gen)}/cause"


def fault_key(spec: str) -> str:
    return f"{PREFIX}/fault/{spec}"


def agent_heartbeat_key(node: int) -> str:
    return f"{PREFIX}/agent/{node}/hb"


def agent_lease_key(node: int) -> str:
    """With etcd: agent ``node``'s sealed "alive" record, bound to its lease, so etcd
    itself deletes it when the agent stops renewing (``launcher.liveness``)."""
    return f"{PREFIX}/agent/{node}/alive"


def agent_info_key(node: int) -> str:
    return f"{PREFIX}/agent/{node}/info"


def rank_process_key(rank: int) -> str:
    return f"{PREFIX}/rank/{rank}/process"


def publish_rank_process(store: dist.Store, rank: int, node: int, pid: int, state: str,
                         **extra: Any) -> None:
    """What the agent that runs ``rank`` knows of its process: ``state`` is "running"
    (started, not seen to exit) or "exited" (with ``exitcode``/``signal``). A rendezvous
    reads it to tell a rank on its way from one that is gone (:mod:`.rendezvous`).
    """
    auth.put(store, rank_process_key(rank), json.dumps(
        {"rank": rank, "node": node, "pid": pid, "state": state, "ts": time.time(), **extra}))


def agent_beats(store: dist.Store, node: int) -> int | None:
    """Agent ``node``'s heartbeat counter (None if absent or not validly sealed)."""
    payload = auth.read(store, agent_heartbeat_key(node))
    return None if payload is None else int(payload)



# Per store client: the sealed cause records of generations 1..G as verified so far, so
# a walk resumes where it stopped and a clobbered record can be put back.
_gen_chains: dict[int, tuple[dist.Store, list[bytes], threading.Lock]] = {}
_gen_chains_lock = threading.Lock()


def _chain(store: dist.Store) -> tuple[list[bytes], threading.Lock]:
    with _gen_chains_lock:
        entry = _gen_chains.setdefault(id(store), (store, [], threading.Lock()))
    return entry[1], entry[2]


def current_generation(store: dist.Store) -> int:
    """The job's current generation (0 before any failure): the number of consecutive
    validly sealed cause records. One ``check`` per call while nothing changes."""
    chain, lock = _chain(store)
    with lock:
        while True:
            key = cause_key(len(chain) + 1)
            if not store.check([key]):
                break
            raw = bytes(store.get(key))
            if auth.open_value(key, raw) is None:
                break  # forged: reported; a legitimate declarer replaces it
            chain.append(raw)
        return len(chain)


def reassert_generations(store: dist.Store) -> None:
    """Put back any verified cause record that was overwritten or deleted since it was read.

    Records of a generation are written once, so restoring the exact sealed bytes is
    always right; it keeps a process that walks the chain later (a replacement) from
    stopping at a record a forger clobbered. Agents call this once per heartbeat.
    """
    current_generation(store)
    records, lock = _chain(store)
    with lock:
        chain = list(records)
    if not chain:
        return
    keys = [cause_key(g) for g in range(1, len(chain) + 1)]
    present = store.check(keys)
    values = store.multi_get(keys) if present else [auth.read_raw(store, k) for k in keys]
    for key, want, have in zip(keys, chain, values):
        if have is None or bytes(have) != want:
            if have is not None:
                auth.report(key, bytes(have))
            store.set(key, want)


def declare_failure(
    store: dist.Store, observed_gen: int, cause: dict[str, Any], timeout_s: float = 30.0
) -> int:
    """Move the job past ``observed_gen``; returns the generation now current.

    The first declarer for a generation wins the compare-and-set of its sealed cause
    record; later declarers of the same failure find a valid record there and just see
    the newer generation. One failure seen by many is one generation. A forged value in
    that slot does not count and is replaced (:func:`recovery.job_store.auth.claim`).
    """
    nxt = observed_gen + 1
    payload = json.dumps(cause)
    deadline = time.monotonic() + timeout_s
    while True:
        auth.claim(store, cause_key(nxt), payload)
        # Wake the ranks blocked on ``observed_gen``'s plan (recovery.generation.rendezvous): a
        # rendezvous that a newer generation supersedes never gets a plan of its own.
        # A plan already published stays (claim never replaces a valid record).
        auth.claim(store, plan_key(observed_gen), json.dumps({SUPERSEDED: nxt}))
        count_failure(store, observed_gen, cause)
        gen = current_generation(store)
        if gen > observed_gen:
            return gen
        if time.monotonic() > deadline:
            raise TimeoutError(f"generation did not advance past {observed_gen}")
        time.sleep(0.005)


def generation_of_process(store: dist.Store, rank: int, pid: int, seen_gen: int,
                          newest: int | None = None) -> int:
    """The newest generation the process ``pid`` of ``rank`` is known to belong to.

    ``seen_gen`` is what its agent last saw while the process showed life, which can be
    stale: a heartbeat file is touched every heartbeat interval, and a recovery takes
    a tenth of that. A process whose sealed join record is in a newer generation's
    rendezvous belongs to that one. Declaring its failure from here
    (:func:`declare_failure`) therefore always leads past every generation it took
    part in, however stale the declarer's view; declaring from ``seen_gen`` folded a
    failure right after a recovery into the generation that had just ended, and
    nobody recovered from it.
    """
    return _newest_joined(store, [rank], lambda rec: rec.pid == pid, seen_gen, newest)


def generation_of_node(store: dist.Store, ranks: list[int], node: int, seen_gen: int,
                       newest: int | None = None) -> int:
    """:func:`generation_of_process` for a lost node: the newest generation any of its
    ``ranks`` joined from that node (a node's heartbeat is as stale as a file's)."""
    return _newest_joined(store, ranks, lambda rec: rec.node == node, seen_gen, newest)


def _newest_joined(store: dist.Store, ranks: list[int], ours: Callable[[JoinRecord], bool],
                   seen_gen: int, newest: int | None) -> int:
    """The newest generation after ``seen_gen`` holding a join record of one of
    ``ranks`` for which ``ours`` holds; ``seen_gen`` if there is none."""
    newest = current_generation(store) if newest is None else newest
    for gen in range(newest, seen_gen, -1):
        for rank in ranks:
            payload = auth.read(store, join_key(gen, rank))
            if payload is not None and ours(JoinRecord.from_json(payload)):
                return gen
    return seen_gen


def recoveries(store: dist.Store) -> int:
    """Generations after 0 so far (one failure can take several: see :func:`failures`)."""
    return current_generation(store)


#: A job whose generations outrun its failures this much is not converging (say, a
#: partition that only ever shows as peer failures); it stops instead of looping.
GENERATIONS_PER_FAILURE = 4


def failure_identity(observed_gen: int, cause: dict[str, Any]) -> str | None:
    """What one failure is, whoever declares it; ``None`` for a consequence.

    A process dies once (rank and pid); a node is lost once per agent process (its
    watchers and the spare node that takes it over declare the same loss); an
    exception is one rank's, in the generation it ran in.
    """
    kind = cause.get("kind")
    if kind in CONSEQUENTIAL or kind is None:
        return None
    if kind in (FailureCause.WORKER_EXIT, FailureCause.WORKER_HUNG, FailureCause.STRAGGLER):
        return f"process-{cause.get('rank')}-{cause.get('pid')}"
    if kind == FailureCause.NODE_LOST:
        return f"node-{cause.get('node')}-{cause.get('agent_pid')}"
    if kind == FailureCause.EXCEPTION:
        return f"exception-{cause.get('rank')}-g{observed_gen}"
    return f"{kind}-{cause.get('rank')}-g{observed_gen}"


def failure_key(n: int) -> str:
    return f"{PREFIX}/failures/{n}"


def count_failure(store: dist.Store, observed_gen: int, cause: dict[str, Any]) -> int:
    """Count the failure behind ``cause`` once, however many declare it; returns the
    failures so far. ``recovery.max_restarts`` is checked against this, not against
    generations: one node loss took 3 generations and was counted as 3 recoveries."""
    ident = failure_identity(observed_gen, cause)
    # Seals are deterministic, so a claim with the same payload as the winner's would
    # read as won: each claimer's payload is its own.
    mine = f"{os.getpid()}-{uuid.uuid4().hex}"
    if ident is not None and auth.claim(store, f"{PREFIX}/failure_id/{ident}", mine)[0]:
        n = failures(store) + 1
        # What the failure was, for the operator's view: a generation's own cause record
        # holds whoever declared first, often a peer that saw a collective fail.
        record = json.dumps({"id": ident, "kind": cause.get("kind"), "rank": cause.get("rank"),
                             "node": cause.get("node"), "gen": observed_gen + 1,
                             "ts": cause.get("ts", time.time())}, default=str)
        while not auth.claim(store, failure_key(n), record)[0]:
            n += 1
    return failures(store)


def failure_record(store: dist.Store, n: int) -> dict[str, Any] | None:
    """The ``n``-th failure (from 1): its kind, rank, node, generation and time."""
    try:
        return read_json(store, failure_key(n))
    except ValueError:  # a record of an older release: its identity only
        return {"id": auth.read(store, failure_key(n))}


def failures(store: dist.Store) -> int:
    """Distinct failures so far: the length of the sealed chain of failure records."""
    n = 0
    while auth.read(store, failure_key(n + 1)) is not None:
        n += 1
    return n


def restart_budget_exceeded(store: dist.Store, max_restarts: int) -> str | None:
    """Why the job must stop for ``recovery.max_restarts``, or ``None``."""
    count, gens = failures(store), current_generation(store)
    if count > max_restarts:
        noun = "failure" if count == 1 else "failures"
        return f"recovery.max_restarts={max_restarts} exceeded ({count} {noun})"
    if gens > GENERATIONS_PER_FAILURE * (max_restarts + 1):
        return (f"recovery is not converging: {gens} generations for {count} failures "
                f"(more than {GENERATIONS_PER_FAILURE} per failure allowed by "
                f"recovery.max_restarts={max_restarts})")
    return None


def read_json(store: dist.Store, key: str) -> Any:
    """The JSON payload of a sealed record; None if absent or not validly sealed."""
    payload = auth.read(store, key)
    return None if payload is None else json.loads(payload)


def set_fatal(store: dist.Store, reason: str, **details: Any) -> None:
    """Record why the job cannot continue; agents print it and stop (first reason wins)."""
    try:
        auth.claim(store, FATAL_KEY, json.dumps({"reason": reason, **details}))
    except auth.StoreTampered as exc:
        print(f"checkpointless: could not record the fatal reason {reason!r}: {exc}",
              file=sys.stderr, flush=True)


def fatal(store: dist.Store) -> dict[str, Any] | None:
    return read_json(store, FATAL_KEY)


# --- Sealed markers (what agents trust about ranks and other agents) --------------------
#: A sealed constant the store host writes first: a joining agent whose job secret
#: differs cannot open it and stops before writing anything.
KEYCHECK_KEY = f"{PREFIX}/keycheck"
_KEYCHECK_TEXT = "checkpointless job key check"


def publish_keycheck(store: dist.Store) -> None:
    auth.put(store, KEYCHECK_KEY, _KEYCHECK_TEXT)


def publish_keycheck_once(store: dist.Store) -> None:
    """Publish the key check unless some agent already did (a store no agent hosts:
    the first to arrive publishes; a later one must not replace it with its own seal,
    or an agent with a wrong secret would make itself right)."""
    sealed = signing.process_signer().seal(KEYCHECK_KEY, _KEYCHECK_TEXT.encode())
    store.compare_set(KEYCHECK_KEY, "", sealed)


def keycheck(store: dist.Store) -> bool | None:
    """True if this process's job key opens the store host's check record, False if
    not, None if there is no record (yet)."""
    raw = auth.read_raw(store, KEYCHECK_KEY)
    if raw is None:
        return None
    return signing.process_signer().open(KEYCHECK_KEY, raw) == _KEYCHECK_TEXT.encode()


class EventLog:
    """Append-only JSON-lines file shared by agents and workers of one run.

    Each event is one ``write`` of one line on an ``O_APPEND`` descriptor, which the
    kernel keeps whole even with many writers.
    """

    def __init__(self, path: str | os.PathLike[str], source: str) -> None:
        self.path = os.fspath(path)
        self.source = source
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        """Append one event; ``event`` must be registered (common.events.Event)."""
        record = {"ts": time.time(), "event": str(registered(event)), "source": self.source,
                  **fields}
        line = (json.dumps(record, default=str) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        return record


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All events of a run, in file order; a torn last line is skipped."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        pass
    return out


# --- Agent coordination (added with ``checkpointless run``) ----------------------------
# Keys only agents write, kept here so the whole store layout stays reviewable in one file.

#: Every agent that ever joined the job: sealed node ids between commas, appended at
#: registration (``launcher.membership.register``).
AGENTS_KEY = f"{PREFIX}/agents"
#: Set (sealed) with the first "done" record: a cheap "has any rank finished?". There is
#: no counter of finished ranks: anyone can overwrite a counter with text, and the next
#: ``add`` to it then fails, so the sealed per-rank records are the only truth.
DONE_ANY_KEY = f"{DONE_PREFIX}/any"


#: Node losses published by the agents that detected them (ADR 0023): each agent watches
#: only its ring neighbours, so the others learn a loss from here. Append-only sealed
#: entries between commas, like ``AGENTS_KEY``; a node's watchers may each add one.
LOST_KEY = f"{PREFIX}/lost"
#: A hint, not a record: a random token rewritten whenever ``AGENTS_KEY`` or ``LOST_KEY``
#: grows, so that a watcher re-reads those two (which grow with the job) only when it
#: changed. A forger can make watchers re-read early, or write an old token back to
#: delay a re-read; watchers re-read at least every ``liveness.REFRESH_EVERY`` checks.
LIVENESS_VERSION_KEY = f"{PREFIX}/liveness/version"


@dataclass(frozen=True)
class LostRecord:
    """One published node loss (sealed; its payload has no commas, see ``LOST_KEY``)."""

    node: int
    seq: int  # the detector's newest verified heartbeat of the node: a beat after it
    #           (a higher sequence number) means the node was alive after all
    gen_alive: int  # the generation current when the detector last saw it alive
    silent_s: float  # how long the detector saw no beat
    by: int  # the detecting node

    def payload(self) -> str:
        return f"{self.node}:{self.seq}:{self.gen_alive}:{round(self.silent_s * 1000)}:{self.by}"

    @staticmethod
    def parse(payload: str) -> LostRecord | None:
        try:
            node, seq, gen, silent_ms, by = (int(x) for x in payload.split(":"))
        except ValueError:
            return None
        return LostRecord(node, seq, gen, silent_ms / 1000, by)


def bump_liveness_version(store: dist.Store) -> None:
    """Tell every watcher that the agents list or the published losses grew (call after
    the append, on the same connection, so the append lands first)."""
    store.set(LIVENESS_VERSION_KEY, uuid.uuid4().hex)


def publish_losses(store: dist.Store, records: list[LostRecord]) -> list[bytes]:
    """Append sealed loss records to ``LOST_KEY``; returns the entries as stored."""
    entries = [signing.process_signer().seal(LOST_KEY, r.payload()) for r in records]
    if entries:
        store.append(LOST_KEY, b"".join(b"," + e + b"," for e in entries))
        bump_liveness_version(store)
    return entries


def sealed_list_entries(raw: bytes | None) -> list[bytes]:
    """The (unverified) entries of an append-only list of sealed values between commas
    (``AGENTS_KEY``, ``LOST_KEY``), in order."""
    return [t for t in bytes(raw).split(b",") if t] if raw else []


def open_lost_entry(entry: bytes) -> LostRecord | None:
    """The record of one entry; None (a forged one is reported) if it does not verify."""
    payload = auth.open_value(LOST_KEY, entry)
    return None if payload is None else LostRecord.parse(payload)


def trained_key(rank: int) -> str:
    """Set by a worker once its last step is committed: whatever it does after that
    (saving, exiting) can no longer need a recovery."""
    return f"{PREFIX}/trained/{rank}"


def done_key(rank: int) -> str:
    return f"{DONE_PREFIX}/{rank}"


def group_owner_key(group: int) -> str:
    """Node id of the agent now running node-group ``group``'s ranks (GROUP_RANK).

    A group is owned by the node of the same rank at launch; when that node is lost, a
    spare node takes the group over with a compare-and-set from the lost owner's id, so
    exactly one agent wins whatever generation each claimer happened to observe.
    """
    return f"{PREFIX}/owner/{group}"


def owner_payload(node: int, epoch: int) -> str:
    """The (to be sealed) payload of a group's owner record: the node and the takeover
    epoch, which only grows."""
    return json.dumps({"node": node, "epoch": epoch})


def parse_owner_payload(payload: str | bytes) -> tuple[int, int]:
    """``(node, epoch)`` of an owner record's payload; ValueError if it is malformed."""
    try:
        d = json.loads(payload)
        return int(d["node"]), int(d["epoch"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"malformed owner record {payload!r:.80}") from exc


def group_owner(store: dist.Store, group: int) -> int | None:
    """The node now owning ``group`` per its sealed owner record; None if unreadable.

    Workers read this to fence themselves: a worker whose node was declared lost (it may
    only have been slow) must not take part in a generation its replacement joins.
    """
    payload = auth.read(store, group_owner_key(group))
    if payload is None:
        return None
    try:
        return parse_owner_payload(payload)[0]
    except ValueError:
        return None


def agent_finished_key(node: int) -> str:
    """Set by an agent that has seen the job end; the store host waits for these."""
    return f"{PREFIX}/agent/{node}/finished"


def mark_trained(store: dist.Store, rank: int, step: int) -> None:
    auth.put(store, trained_key(rank), str(step))


def is_trained(store: dist.Store, rank: int) -> bool:
    """Has ``rank`` (validly) recorded that its last step is committed?"""
    return auth.read(store, trained_key(rank)) is not None


def record_done(store: dist.Store, rank: int) -> None:
    """Record (sealed) that ``rank`` finished with status 0."""
    key = done_key(rank)
    if auth.read(store, key) is None:
        auth.put(store, key, "1")
    if auth.read(store, DONE_ANY_KEY) is None:
        auth.put(store, DONE_ANY_KEY, "1")


def any_done(store: dist.Store) -> bool:
    return auth.read(store, DONE_ANY_KEY) is not None


def done_ranks(store: dist.Store, world_size: int) -> set[int]:
    """The ranks with a validly sealed "done" record."""
    keys = [done_key(r) for r in range(world_size)]
    values = auth.read_all(store, keys)
    if values is None:
        values = [auth.read(store, k) for k in keys]
    return {r for r, v in enumerate(values) if v is not None}


def mark_agent_finished(store: dist.Store, node: int) -> None:
    auth.put(store, agent_finished_key(node), "1")


def agent_finished(store: dist.Store, node: int) -> bool:
    return auth.read(store, agent_finished_key(node)) is not None
