"""Turn a run's events into what the report shows: failures, recoveries, steps, summary.

One *failure* is one episode: from a failure until training resumes. Every detector of
the same failure dedupes into one generation (``recovery.generation.protocol.declare_failure``),
and generations superseded before anyone resumed (a failure during the recovery, a
spare node taking a lost node's ranks over) are folded into the episode that ended in
a recovery, so a node loss is one failure however many generations it took. For each
episode this module gathers every piece of evidence (the agents' declared causes,
injected faults, the workers' ``recovery`` and ``resumed`` events) and derives:

* the failure time: the first injected fault when there is one, else the earliest
  evidence (the first detection, or the last sign of life of a node or worker declared
  lost from its silence: the recovery event's ``fault_at``);
* the recovery phases of the *critical* rank, the one that finished recovering last:
  detect (failure -> that rank knew what failed: its own notice, or the verdict on a
  silent node or worker it waited for), abort, rendezvous, transfer, first step.
  They are the intervals between that rank's own timestamps (rebuilt from its
  ``recovered_at`` and ``timings``), clipped to the episode, so they are disjoint and
  add up to the recovery time (failure -> first step done after it); a rank that
  noticed before the episode's failure time (an earlier generation's) starts at it;
* the steps lost: the newest step rank 0 completed before the failure minus the step
  the job rolled back to (work done again).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from recovery.common.causes import describe
from recovery.common.events import Event

#: Recovery phases in the order they happen (keys of the ``recovery`` event's timings),
#: then the first step after it (from the ``resumed`` event).
PHASES = ("detect_s", "abort_s", "rendezvous_s", "transfer_s", "first_step_s")
PHASE_LABELS = {"detect_s": "detect", "abort_s": "abort", "rendezvous_s": "rendezvous",
                "transfer_s": "transfer", "first_step_s": "first step"}


@dataclass
class Failure:
    """One generation's failure and (when it happened) its recovery."""

    gen: int
    detected_at: float
    what: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)  # injected fault specs
    fault_times: list[float] = field(default_factory=list)
    failed_at: float = 0.0
    recovered_at: float | None = None
    resumed_at: float | None = None
    target_step: int | None = None
    steps_lost: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    critical_rank: int | None = None
    newcomers: list[int] = field(default_factory=list)
    replacements: list[str] = field(default_factory=list)
    bytes_transferred: int = 0
    via: str = "memory"  # or "durable" (every in-memory copy was lost)
    outcome: str = "recovered"
    superseded: list[int] = field(default_factory=list)  # generations folded into this one
    # the critical rank's detect, abort, rendezvous-end and recovered times (absolute)
    marks: tuple[float, float, float, float] | None = None

    @property
    def gens_text(self) -> str:
        """The generation, or the range this episode spans ("1-3")."""
        return f"{self.superseded[0]}-{self.gen}" if self.superseded else str(self.gen)

    @property
    def recovered(self) -> bool:
        return self.recovered_at is not None

    @property
    def recovery_s(self) -> float | None:
        """Failure -> first step done after the recovery (or the recovery's end)."""
        end = self.resumed_at or self.recovered_at
        return None if end is None else max(0.0, end - self.failed_at)


@dataclass
class Run:
    """Everything the report shows, derived from the events only."""

    t0: float
    t_end: float
    world_size: int
    agents: list[int]
    steps: list[tuple[float, int, float | None]]  # (ts, step, snapshot stall or None)
    replications: list[tuple[float, dict[str, Any]]]  # (ts, round stats)
    failures: list[Failure]
    marks: list[tuple[float, str, str]]  # (ts, lane, label): failures, workers, ...
    outcome: str
    final_step: int | None
    config: dict[str, Any]
    cwd: str | None
    counts: dict[str, int]

    @property
    def recoveries(self) -> list[Failure]:
        return [f for f in self.failures if f.recovered]

    @property
    def duration_s(self) -> float:
        return max(0.0, self.t_end - self.t0)


def build_run(events: list[dict[str, Any]]) -> Run:
    """The report's model of a run; ``events`` must be sorted by ``ts``."""
    by: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        by.setdefault(e["event"], []).append(e)
    t0, t_end = float(events[0]["ts"]), float(events[-1]["ts"])
    steps = [(float(e["ts"]), int(e["step"]), e.get("stall_s")) for e in by.get(Event.STEP, [])
             if isinstance(e.get("step"), int)]
    replications = [(float(e["ts"]), e["replicated"]) for e in by.get(Event.STEP, [])
                     if isinstance(e.get("replicated"), dict)]
    starts = by.get(Event.AGENT_START, [])
    config = next((e["config"] for e in starts if isinstance(e.get("config"), dict)), {})
    failures = _failures(by, steps)
    return Run(
        t0=t0, t_end=t_end, world_size=_world_size(by), agents=_agents(by),
        steps=steps, replications=replications, failures=failures, marks=_marks(by),
        outcome=_outcome(by), final_step=_final_step(by, steps), config=config,
        cwd=next((str(e["cwd"]) for e in starts if e.get("cwd")), None),
        counts={name: len(evs) for name, evs in sorted(by.items())},
    )


def _world_size(by: dict[str, list[dict[str, Any]]]) -> int:
    sizes = [int(e["world_size"]) for e in by.get(Event.AGENT_START, [])
             if isinstance(e.get("world_size"), int)]
    if sizes:
        return max(sizes)
    ranks = [e.get("rank") for name in (Event.WORKER_START, Event.WORKER_READY, Event.RECOVERY)
             for e in by.get(name, [])]
    ints = [r for r in ranks if isinstance(r, int)]
    return max(ints) + 1 if ints else 0


def _agents(by: dict[str, list[dict[str, Any]]]) -> list[int]:
    return sorted({int(e["node"]) for e in by.get(Event.AGENT_START, [])
                   if isinstance(e.get("node"), int)})


def _final_step(by: dict[str, list[dict[str, Any]]],
                steps: list[tuple[float, int, float | None]]) -> int | None:
    done = [int(e["step"]) for e in by.get(Event.WORKER_DONE, []) if isinstance(e.get("step"), int)]
    if done:
        return max(done)
    return steps[-1][1] if steps else None


def _outcome(by: dict[str, list[dict[str, Any]]]) -> str:
    if by.get(Event.JOB_FAILED):
        return f"failed: {by[Event.JOB_FAILED][0].get('reason', '?')}"
    if by.get(Event.JOB_DONE):
        return "completed"
    if by.get(Event.AGENT_EXIT):
        return f"stopped by {by[Event.AGENT_EXIT][0].get('signal', 'a signal')}"
    return "unfinished (no job_done or job_failed event: still running, or the agents died)"


def _failures(by: dict[str, list[dict[str, Any]]],
              steps: list[tuple[float, int, float | None]]) -> list[Failure]:
    gens: dict[int, Failure] = {}

    def failure(gen: int, ts: float) -> Failure:
        f = gens.get(gen)
        if f is None:
            f = gens[gen] = Failure(gen=gen, detected_at=ts, failed_at=ts)
        return f

    for e in by.get(Event.FAILURE_DECLARED, []):
        cause = e.get("cause") or {}
        f = failure(int(e["gen"]), float(cause.get("ts", e["ts"])))
        _add(f.what, describe(cause))
    recs = [e for e in by.get(Event.RECOVERY, []) if isinstance(e.get("gen"), int)]
    declared = set(gens)  # generations an agent described (exit, hang, node loss)
    for e in recs:
        cause = e.get("cause") or {}
        f = failure(int(e["gen"]), float(cause.get("ts", e["ts"])))
        f.detected_at = min(f.detected_at, float(cause.get("ts", f.detected_at)))
        if f.gen not in declared and cause:
            _add(f.what, describe(cause))  # a worker's own cause: an exception, say
    for f in gens.values():
        _fill_recovery(f, [e for e in recs if e["gen"] == f.gen], by)
    for e in by.get(Event.DURABLE_FALLBACK, []):
        if int(e.get("gen", -1)) in gens:
            f = gens[int(e["gen"])]
            f.via = "durable"
            f.steps_lost = max(f.steps_lost, int(e.get("steps_lost") or 0))
    ordered = sorted(gens.values(), key=lambda f: f.gen)
    _assign_faults(ordered, by.get(Event.FAULT_INJECTED, []))
    ordered = _fold_superseded(ordered)
    for f in ordered:
        f.failed_at = min([f.detected_at, *f.fault_times])
        _clip_phases(f)
        if not f.what and f.faults:
            f.what.append(f"injected fault {f.faults[0]}")
        before = [s for ts, s, _ in steps if ts <= f.detected_at]
        if f.target_step is not None and before and f.via == "memory":
            f.steps_lost = max(0, max(before) - f.target_step)
    _mark_unrecovered(ordered, by)
    return ordered


def _fill_recovery(f: Failure, recs: list[dict[str, Any]],
                   by: dict[str, list[dict[str, Any]]]) -> None:
    for e in by.get(Event.REPLACEMENT_ASSIGNED, []):
        if e.get("gen") == f.gen:
            how = "a warm spare" if e.get("spare") else "a new process"
            _add(f.replacements, f"rank {e.get('rank')} -> {how} (pid {e.get('pid')})")
    if not recs:
        return
    last = max(recs, key=lambda e: float(e.get("recovered_at", e["ts"])))
    f.recovered_at = float(last.get("recovered_at", last["ts"]))
    f.critical_rank = last.get("rank")
    f.target_step = int(last.get("target_step", -1))
    timings = last.get("timings") or {}
    if last.get("fault_at") is not None:  # the last sign of life of what failed
        f.fault_times.append(float(last["fault_at"]))
    t_pg = f.recovered_at - float(timings.get("transfer_s", 0.0))
    t_abort = t_pg - float(timings.get("rendezvous_s", 0.0))
    f.marks = (t_abort - float(timings.get("abort_s", 0.0)), t_abort, t_pg, f.recovered_at)
    f.newcomers = sorted({int(r) for e in recs for r in e.get("newcomers") or []})
    f.bytes_transferred = sum(int(e.get("bytes_transferred") or 0) for e in recs
                              if e.get("newcomer"))
    resumed = [e for e in by.get(Event.RESUMED, []) if e.get("gen") == f.gen]
    if resumed:
        f.resumed_at = max(float(e["ts"]) for e in resumed)
    for e in by.get(Event.NODE_TAKEOVER, []):
        if f.detected_at - 1 <= float(e["ts"]) <= f.recovered_at:
            _add(f.replacements, f"ranks {e.get('ranks')} -> node {e.get('node')}")


def _fold_superseded(ordered: list[Failure]) -> list[Failure]:
    """Fold each generation nobody recovered in, followed by another, into the next one:
    one episode from the first failure to the recovery that ended it."""
    out: list[Failure] = []
    carry: Failure | None = None
    for i, f in enumerate(ordered):
        if carry is not None:
            f.what[:] = carry.what + [w for w in f.what if w not in carry.what]
            f.replacements[:] = carry.replacements + [
                r for r in f.replacements if r not in carry.replacements]
            f.faults[:0] = [x for x in carry.faults if x not in f.faults]
            f.fault_times[:0] = carry.fault_times
            f.detected_at = min(f.detected_at, carry.detected_at)
            f.superseded = [*carry.superseded, carry.gen]
            carry = None
        if not f.recovered and i + 1 < len(ordered):
            carry = f
            continue
        out.append(f)
    return out


def _clip_phases(f: Failure) -> None:
    """The critical rank's phases as disjoint intervals from the failure to the first
    step after the recovery (see the module docstring)."""
    if f.marks is None:
        return
    end = f.resumed_at if f.resumed_at is not None else f.marks[-1]
    bounds, prev = [], f.failed_at
    for t in (*f.marks, end):
        prev = max(prev, t)
        bounds.append(prev)
    starts = [f.failed_at, *bounds[:-1]]
    f.phases = {k: round(b - a, 6) for k, a, b in zip(PHASES, starts, bounds)}


def _assign_faults(ordered: list[Failure], faults: list[dict[str, Any]]) -> None:
    """Each injected fault belongs to the first generation detected after it fired."""
    for e in faults:
        ts = float(e["ts"])
        for f in ordered:
            if f.detected_at >= ts - 0.05:
                _add(f.faults, str(e.get("fault", "?")))
                f.fault_times.append(ts)
                break


def _mark_unrecovered(ordered: list[Failure], by: dict[str, list[dict[str, Any]]]) -> None:
    fatal = by.get(Event.JOB_FAILED) or by.get(Event.FATAL) or []
    for i, f in enumerate(ordered):
        if f.recovered:
            continue
        later = [g.gen for g in ordered[i + 1:]]
        if later:
            f.outcome = f"superseded by generation {later[0]} (a failure during recovery)"
        elif fatal:
            f.outcome = f"not recovered: {fatal[0].get('reason', '?')}"
        else:
            f.outcome = "not recovered (no recovery event)"


def _marks(by: dict[str, list[dict[str, Any]]]) -> list[tuple[float, str, str]]:
    out: list[tuple[float, str, str]] = []
    done = {e.get("source"): float(e["ts"]) for e in by.get(Event.WORKER_DONE, [])}

    def lane(e: dict[str, Any]) -> str:
        """A rank that had finished training and then stalled or crashed on its way out
        did not fail the job (the agent records it as done)."""
        finished = done.get(f"rank{e.get('rank')}")
        return "workers" if finished is not None and finished < float(e["ts"]) else "failures"

    for e in by.get(Event.FAULT_INJECTED, []):
        out.append((float(e["ts"]), "failures", f"fault {e.get('fault')}"))
    for e in by.get(Event.WORKER_EXIT, []):
        if e.get("exitcode") not in (0, None):
            what = e.get("signal") or f"exit {e.get('exitcode')}"
            out.append((float(e["ts"]), lane(e), f"rank {e.get('rank')} {what}"))
    for e in by.get(Event.WORKER_HUNG, []):
        out.append((float(e["ts"]), lane(e), f"rank {e.get('rank')} hung"))
    for e in by.get(Event.NODE_LOST, []):
        out.append((float(e["ts"]), "failures", f"node {e.get('lost_node')} lost"))
    for e in by.get(Event.FAILURE_DECLARED, []):
        out.append((float(e["ts"]), "declared", f"gen {e.get('gen')}"))
    for e in by.get(Event.WORKER_START, []):
        label = f"rank {e.get('rank')}" + (" (spare)" if e.get("spare") else "")
        out.append((float(e["ts"]), "workers", label))
    for e in by.get(Event.JOB_FAILED, []) + by.get(Event.FATAL, []):
        out.append((float(e["ts"]), "failures", "fatal"))
    return sorted(out)


def _add(items: list[str], item: str) -> None:
    if item not in items:
        items.append(item)
