"""Goodput arithmetic over a run's event timeline (pure functions, no processes).

Definitions (the benchmark's docstring and ``docs/chaos.md`` repeat them in prose):

- **training window** ``T``: from the first completion of the warm-up step ``W`` to the
  last completion of the final step, on rank 0. Job start-up (interpreters, ``import
  torch``, rendezvous, warm spares still importing torch during the first steps) and
  shutdown are outside it, for every run alike; no failure is injected before ``W``.
- **goodput** = ``T_ff / T_chaos``: the failure-free run's window (same system, same
  configuration, same steps) over the chaos run's. The productive step time is what
  the steps take when nothing fails, so goodput is the share of wall time spent
  making progress, and everything failures cost (detection, recovery, replayed
  steps, slower steps around a recovery) is what is missing from 1.
- an **incident** is one interruption of training: every fault that fired between the
  completion of the previous in-process recovery and the completion of the next one
  (two faults at once, or one during a recovery, make a single incident). A recovery
  nobody injected a fault for is an *unplanned* incident and is costed the same way.
- per incident, from the events: ``detect`` = first fault -> first detection event
  (a rank's ``failure_detected`` or an agent's ``failure_declared``); ``recover`` =
  detection -> the moment the last rank finished its recovery (``recovered_at`` of the
  ``recovery`` events of the generation that completed); ``resume`` = how much longer
  than a failure-free step (``step_s``) the first step after the recovery took on rank
  0: the new process groups connect, a newcomer fills its first snapshot buffers and
  starts its durable writer, so recovery is only over once training steps again;
  ``lost`` = work lost = the completion of the step recovered to (the committed step)
  -> the first fault.
- **goodput_bound** = ``1 - sum(detect + recover + resume + lost) / T_chaos``, i.e.
  ``1 - (detect + recover + lost work per failure) / MTBF`` (``recover`` including the
  resume) with the realized
  ``MTBF = T_chaos / incidents``: what goodput would be if failures cost exactly their
  measured parts and nothing else. ``goodput_over_bound`` near 1 says the measured
  parts explain the loss; below 1, something else (contention, slow steps after a
  recovery) costs time too.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from recovery.common.events import Event
from replication.errors import CheckpointlessError

Record = Mapping[str, Any]  # one event of a run, as read back

DETECTION_EVENTS = (Event.FAILURE_DETECTED, Event.FAILURE_DECLARED)
TIMING_KEYS = ("detect_s", "abort_s", "rendezvous_s", "transfer_s")


class MetricsError(CheckpointlessError, ValueError):
    """The timeline lacks what a figure needs (the message says what)."""


def step_events(events: Iterable[Record], source: str = "rank0") -> list[Record]:
    """Rank 0's ``step`` events (``source`` rank0 in events.jsonl, rank 0 in progress)."""
    return [e for e in events if e.get("event") == Event.STEP
            and (e.get("source") == source or (e.get("source") is None and e.get("rank") == 0))]


def training_window(
    events: Iterable[Record], last_step: int, first_step: int = 1
) -> tuple[float, float]:
    """(first completion of ``first_step``, last completion of ``last_step``) on rank 0."""
    steps = step_events(events)
    firsts = [float(e["ts"]) for e in steps if int(e["step"]) == first_step]
    ends = [float(e["ts"]) for e in steps if int(e["step"]) == last_step]
    if not firsts or not ends:
        raise MetricsError(
            f"rank 0 never completed step {first_step if not firsts else last_step}")
    return min(firsts), max(ends)


def window_s(events: Iterable[Record], last_step: int, first_step: int = 1) -> float:
    start, end = training_window(events, last_step, first_step)
    return end - start


def median_step_s(events: Iterable[Record]) -> float:
    """Median time between rank 0 completing a step and the next one (consecutive step
    numbers only): the run's own failure-free pace, robust to the slow steps around
    failures as long as they are fewer than half."""
    steps = step_events(events)
    gaps = [float(b["ts"]) - float(a["ts"]) for a, b in itertools.pairwise(steps)
            if int(b["step"]) == int(a["step"]) + 1]
    if not gaps:
        raise MetricsError("no two consecutive steps completed on rank 0")
    return statistics.median(gaps)


def goodput(t_failure_free: float, t_chaos: float) -> float:
    if t_chaos <= 0 or t_failure_free <= 0:
        raise MetricsError(f"window lengths must be > 0, got {t_failure_free}, {t_chaos}")
    return t_failure_free / t_chaos


def goodput_bound(total_cost_s: float, t_chaos: float) -> float:
    """``1 - cost / T``; equal to ``1 - (cost per incident) / (T / incidents)``."""
    if t_chaos <= 0:
        raise MetricsError(f"the chaos window must be > 0, got {t_chaos}")
    return 1.0 - total_cost_s / t_chaos


@dataclass
class Incident:
    gen: int  # the generation whose recovery completed it
    faults: list[Record] = field(default_factory=list)
    start: float = 0.0  # first fault (or first detection when unplanned)
    detected: float = 0.0
    recovered: float = 0.0
    target_step: int = 0
    target_done: float = 0.0  # when the step recovered to had completed
    resumed: float = 0.0  # when rank 0 first completed the step after it (0: never)
    step_s: float = 0.0  # a failure-free step, for the resume excess
    newcomers: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # worst rank, per phase

    @property
    def planned(self) -> bool:
        return bool(self.faults)

    @property
    def detect_s(self) -> float:
        return max(0.0, self.detected - self.start)

    @property
    def recover_s(self) -> float:
        return max(0.0, self.recovered - self.detected)

    @property
    def resume_s(self) -> float:
        if not self.resumed or not self.step_s:
            return 0.0
        return max(0.0, self.resumed - self.recovered - self.step_s)

    @property
    def lost_s(self) -> float:
        return max(0.0, self.start - self.target_done)

    @property
    def cost_s(self) -> float:
        return self.detect_s + self.recover_s + self.resume_s + self.lost_s

    def summary(self) -> dict[str, Any]:
        return {
            "gen": self.gen, "target_step": self.target_step,
            "faults": [e.get("fault") for e in self.faults],
            "detect_s": round(self.detect_s, 3), "recover_s": round(self.recover_s, 3),
            "resume_s": round(self.resume_s, 3), "lost_s": round(self.lost_s, 3),
            "newcomers": self.newcomers,
        }


def incidents(events: Sequence[Record], step_s: float = 0.0) -> list[Incident]:
    """Cut the timeline into incidents, one per completed in-process recovery.

    ``step_s`` (a failure-free step) turns on the ``resume`` part; 0 leaves it out.
    """
    recs: dict[int, list[Record]] = {}
    for e in events:
        if e.get("event") == Event.RECOVERY:
            recs.setdefault(int(e["gen"]), []).append(e)
    faults = sorted((e for e in events if e.get("event") == Event.FAULT_INJECTED),
                    key=lambda e: float(e["ts"]))
    detections = sorted(float(e["ts"]) for e in events if e.get("event") in DETECTION_EVENTS)
    steps = step_events(events)
    ready0 = [float(e["ts"]) for e in events if e.get("event") == Event.WORKER_READY
              and e.get("source") == "rank0" and int(e.get("gen", 0)) == 0]
    out: list[Incident] = []
    prev_done = float("-inf")
    for gen in sorted(recs):
        rs = recs[gen]
        inc = Incident(gen=gen, recovered=max(float(e["recovered_at"]) for e in rs),
                       target_step=int(rs[0]["target_step"]),
                       newcomers=sorted({int(n) for e in rs for n in e.get("newcomers", [])}))
        inc.faults = [f for f in faults if prev_done < float(f["ts"]) <= inc.recovered]
        after = [t for t in detections if prev_done < t <= inc.recovered]
        if inc.faults:
            inc.start = float(inc.faults[0]["ts"])
            later = [t for t in after if t >= inc.start]
            inc.detected = later[0] if later else inc.start
        else:
            inc.start = inc.detected = after[0] if after else inc.recovered
        done = [float(e["ts"]) for e in steps
                if int(e["step"]) == inc.target_step and float(e["ts"]) <= inc.start]
        if done:
            inc.target_done = max(done)
        elif inc.target_step == 0 and ready0:
            inc.target_done = ready0[0]
        else:
            inc.target_done = inc.start
        for key in TIMING_KEYS:
            vals = [float(e["timings"][key]) for e in rs if key in e.get("timings", {})]
            if vals:
                inc.timings[key] = max(vals)
        inc.step_s = step_s
        out.append(inc)
        prev_done = inc.recovered
    # The first completion of target+1 after the recovery, before the next incident's
    # first fault (a step interrupted again never resumed this incident).
    for inc, nxt in zip(out, [*out[1:], None]):
        limit = nxt.start if nxt is not None else float("inf")
        after = [float(e["ts"]) for e in steps if int(e["step"]) == inc.target_step + 1
                 and inc.recovered < float(e["ts"]) <= limit]
        inc.resumed = min(after, default=0.0)
    return out


def unresolved_faults(events: Sequence[Record]) -> list[Record]:
    """Faults that fired after the last completed recovery and before the run ended."""
    done = [float(e["recovered_at"]) for e in events if e.get("event") == Event.RECOVERY]
    last = max(done, default=float("-inf"))
    return [e for e in events if e.get("event") == Event.FAULT_INJECTED and float(e["ts"]) > last]


def count_fallbacks(events: Iterable[Record]) -> int:
    """Distinct durable fallbacks (``durable_fallback`` events, one per generation)."""
    keys = {(e.get("gen"), e.get("step"), e.get("path")) if e.get("gen") is None
            else e.get("gen") for e in events if e.get("event") == Event.DURABLE_FALLBACK}
    return len(keys)


def mean(xs: Sequence[float]) -> float:
    return statistics.fmean(xs) if xs else 0.0


def breakdown(incs: Sequence[Incident]) -> dict[str, float]:
    """Mean per incident of each cost part, and of the runtime's own phase timings."""
    out = {
        "detect_s": mean([i.detect_s for i in incs]),
        "recover_s": mean([i.recover_s for i in incs]),
        "resume_s": mean([i.resume_s for i in incs]),
        "lost_work_s": mean([i.lost_s for i in incs]),
    }
    for key in TIMING_KEYS[1:]:
        out[f"recovery_{key}"] = mean([i.timings.get(key, 0.0) for i in incs])
    return out


def young_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval ``sqrt(2 * C * MTBF)``."""
    return (2.0 * max(save_s, 1e-6) * mtbf_s) ** 0.5


def false_losses(events: Sequence[Record]) -> int:
    """Nodes declared lost that were alive: each one fenced after a takeover
    (``node_fenced``, from the node itself) or back before any (``node_returned``, one
    per lost node and group, whoever saw it). A node a fault killed is never either."""
    fenced = [e for e in events if e.get("event") == Event.NODE_FENCED]
    returned = {(e.get("lost_node"), e.get("group")) for e in events
                if e.get("event") == Event.NODE_RETURNED}
    return len(fenced) + len(returned)
