"""Where a recovery's seconds went: disjoint phases from the fault to the recovered state.

A recovery event's ``timings`` split the time from the failure to the end of the
handover into phases that follow each other and add up (the ``resumed`` event's
``resume_s`` adds the first step after it):

- ``detect_s``: from the fault to the moment this rank knew what failed. The fault is
  the earliest evidence among the episode's causes: a process's exit as its agent saw
  it, or, for a verdict reached from silence (a node or a worker that stopped
  heartbeating, ``silent_s`` in its cause), the last sign of life. The knowing is this
  rank's own notice, or the declaration of the last silence verdict of the episode if
  that came later. A node SIGKILLed with its agent first shows up as a peer's failed
  collective in milliseconds; the survivors then wait in the rendezvous for ranks that
  will never join, until an agent declares the node lost. That wait is detection, not
  rendezvous.
- ``abort_s``: tearing down the failed generation (after detection ended).
- ``rendezvous_s``: joining the generation that recovered, up to its process groups;
  ``rendezvous_join_s`` is the part until the plan was published (not a phase of its
  own: it lies inside ``rendezvous_s``).
- ``transfer_s``: the handover, to the recovered state.

Each phase starts where the previous one ended, and a phase that was over before the
previous one ended counts zero, so ``sum(phases) == recovered_at - fault_at`` exactly.
"""

from __future__ import annotations

from typing import Any

PHASES = ("detect_s", "abort_s", "rendezvous_s", "transfer_s")


def fault_at(causes: list[dict[str, Any]], default: float) -> float:
    """The earliest evidence of the failure among ``causes`` (``ts``, or ``ts - silent_s``
    for a verdict reached from silence)."""
    times = [float(c["ts"]) - float(c.get("silent_s") or 0.0) for c in causes if "ts" in c]
    return min(times, default=default)


def phases(causes: list[dict[str, Any]], noticed: float, aborted: float, planned: float,
           grouped: float, recovered: float) -> dict[str, float]:
    """The phases of one rank's recovery (see the module docstring).

    ``causes``: the cause records of every generation from the first failure of the
    episode to the one that recovered, in order. ``noticed``: when this rank noticed the
    first failure; ``aborted``: when its teardown ended; ``planned``: when it had the
    recovering generation's plan; ``grouped``: when that generation's process groups
    were up; ``recovered``: when the handover ended (all ``time.time()``).
    """
    start = fault_at(causes, noticed)
    verdicts = [float(c["ts"]) for c in causes if c.get("silent_s") is not None and "ts" in c]
    known = max([noticed, *[v for v in verdicts if v <= grouped]])
    bounds, prev = [], start
    for t in (known, aborted, grouped, recovered):
        prev = max(prev, t)
        bounds.append(prev)
    out = {k: round(b - a, 6) for k, a, b in zip(PHASES, [start, *bounds[:-1]], bounds)}
    out["rendezvous_join_s"] = round(max(0.0, planned - bounds[1]), 6)
    return out


def outcome(info: dict[str, Any]) -> dict[str, Any]:
    """The part of a recovery event an operator's status view shows: the cause, when it
    struck, how long the recovery took and where training went on from."""
    timings = info.get("timings") or {}
    cause = info.get("cause") or {}
    return {"kind": cause.get("kind"), "rank": cause.get("rank"), "node": cause.get("node"),
            "fault_at": info.get("fault_at"), "recovered_at": info.get("recovered_at"),
            "recovery_s": round(sum(float(timings.get(p) or 0.0) for p in PHASES), 3),
            "target_step": info.get("target_step"), "live": bool(info.get("live")),
            "newcomers": info.get("newcomers")}
