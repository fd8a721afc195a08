"""What ``checkpointless status`` shows: a running job, read from its job store.

Everything comes from sealed records the job keeps anyway, plus two kinds written for
this view: each agent's node progress every few seconds
(``protocol.node_progress_key``: its ranks' newest step, goodput and step rate) and
rank 0's outcome of each recovery (``protocol.recovered_key``: what it cost). Reading
is a few dozen store reads whatever the job's age: the newest :data:`INCIDENTS`
failures only (each from the job's failure chain, which names what failed even when a
peer that saw a collective fail declared the generation first).

Node states:

- ``training``: it owns a node group (its ranks run there) and no loss of it is known;
- ``spare``: it owns none and waits to take a lost node's ranks;
- ``lost``: a loss of it was published and it still owns its group (a takeover or a
  shrink is under way, or it came back before one), or it was a spare node;
- ``fenced``: it was declared lost and its ranks run elsewhere (or the job shrank);
- ``finished``: its agent saw the job end (or left it, as an unfit spare does).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch.distributed as dist

from launcher import membership
from recovery.generation import protocol, status_records
from recovery.job_store import auth
from replication.replica_protocol.commit import committed_step

#: The newest failures shown as incidents.
INCIDENTS = 5
#: Generations after a failure's first in which its recovery's outcome is looked for
#: (a failure during a recovery makes another).
RECOVERY_GENERATIONS = 4


@dataclass
class NodeStatus:
    node: int
    host: str
    state: str
    ranks: list[int]
    step: int | None = None
    goodput: float | None = None
    steps_per_s: float | None = None
    spares_idle: int | None = None
    seen_s: float | None = None  # since its agent last published its progress


@dataclass
class Incident:
    gen: int
    cause: str
    where: str
    at: float | None
    recovery_s: float | None = None
    target_step: int | None = None
    live: bool | None = None


@dataclass
class JobStatus:
    job_id: str
    store: str
    generation: int
    committed_step: int
    failures: int
    fatal: str | None
    nodes: list[NodeStatus] = field(default_factory=list)
    incidents: list[Incident] = field(default_factory=list)
    read_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _lost_nodes(store: dist.Store) -> set[int]:
    entries = protocol.sealed_list_entries(auth.read_raw(store, protocol.LOST_KEY))
    return {r.node for e in entries if (r := protocol.open_lost_entry(e)) is not None}


def _where(cause: dict[str, Any]) -> str:
    parts = []
    if cause.get("rank") is not None:
        parts.append(f"rank {cause['rank']}")
    if cause.get("node") is not None:
        parts.append(f"node {cause['node']}")
    return ", ".join(parts) or "-"


def read(store: dist.Store, job_id: str, where: str) -> JobStatus:
    """The job as its store shows it now."""
    gen = protocol.current_generation(store)
    fatal = protocol.fatal(store)
    status = JobStatus(job_id=job_id, store=where, generation=gen,
                       committed_step=committed_step(store), failures=protocol.failures(store),
                       fatal=None if fatal is None else str(fatal.get("reason")),
                       read_at=time.time())
    nodes = membership.registered_nodes(store)
    infos = {n: membership.agent_info(store, n) or {} for n in nodes}
    groups = sum(1 for i in infos.values() if not i.get("spare"))
    nproc = max([int(i.get("nproc") or 1) for i in infos.values()], default=1)
    owners = membership.owners(store, groups)
    lost = _lost_nodes(store)
    now = time.time()
    for n in nodes:
        info = infos[n]
        owned = sorted(g for g, owner in owners.items() if owner == n)
        ranks = [g * nproc + i for g in owned for i in range(nproc)]
        if protocol.agent_finished(store, n):
            state = "finished"
        elif n in lost:
            state = "lost" if owned or info.get("spare") else "fenced"
        else:
            state = "training" if owned else "spare"
        progress = protocol.read_json(store, status_records.node_progress_key(n)) or {}
        status.nodes.append(NodeStatus(
            node=n, host=str(info.get("host", "?")), state=state, ranks=ranks,
            step=progress.get("step"), goodput=progress.get("goodput"),
            steps_per_s=progress.get("steps_per_s"), spares_idle=progress.get("spares_idle"),
            seen_s=round(now - float(progress["ts"]), 1) if progress.get("ts") else None))
    for n in range(status.failures, max(0, status.failures - INCIDENTS), -1):
        failure = protocol.failure_record(store, n) or {}
        first = int(failure.get("gen") or gen)
        done: dict[str, Any] = {}
        for g in range(first, min(gen, first + RECOVERY_GENERATIONS) + 1):
            if (done := protocol.read_json(store, status_records.recovered_key(g)) or {}):
                break  # the generation whose recovery completed this incident
        status.incidents.append(Incident(
            gen=first, cause=str(failure.get("kind") or "unknown"), where=_where(failure),
            at=failure.get("ts"), recovery_s=done.get("recovery_s"),
            target_step=done.get("target_step"), live=done.get("live")))
    return status


def _fmt(value: Any, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def render(s: JobStatus) -> str:
    """The status as the terminal shows it (a screenful, refreshed in place)."""
    step = max((n.step for n in s.nodes if n.step is not None), default=None)
    rate = max((n.steps_per_s for n in s.nodes if n.steps_per_s is not None), default=None)
    lines = [
        f"job {s.job_id!r} at {s.store}  ({time.strftime('%H:%M:%S', time.localtime(s.read_at))})",
        f"generation {s.generation}   committed step {s.committed_step}   newest step "
        f"{_fmt(step)}   {_fmt(rate, '.2f')} steps/s   failures {s.failures}",
    ]
    if s.fatal:
        lines.append(f"STOPPED: {s.fatal}")
    lines += ["", f"{'node':>4}  {'host':<16} {'state':<10} {'ranks':<14} {'step':>7} "
              f"{'goodput':>7} {'spares':>6} {'seen':>6}"]
    for n in s.nodes:
        ranks = ",".join(map(str, n.ranks)) or "-"
        lines.append(f"{n.node:>4}  {n.host[:16]:<16} {n.state:<10} {ranks[:14]:<14} "
                     f"{_fmt(n.step):>7} {_fmt(n.goodput, '.3f'):>7} "
                     f"{_fmt(n.spares_idle):>6} {_fmt(n.seen_s, '.0f') + 's':>6}")
    lines += ["", "incidents (newest first):" if s.incidents else "incidents: none"]
    for i in s.incidents:
        at = time.strftime("%H:%M:%S", time.localtime(i.at)) if i.at else "?"
        cost = (f"recovered in {i.recovery_s:.2f}s to step {i.target_step}"
                f"{' (live: nothing replayed)' if i.live else ''}"
                if i.recovery_s is not None else "recovering (or no record)")
        lines.append(f"  gen {i.gen:>3}  {at}  {i.cause:<24} {i.where:<18} {cost}")
    return "\n".join(lines)
