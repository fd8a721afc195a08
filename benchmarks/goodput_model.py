"""Goodput against MTBF: checkpointless vs torchrun + DCP async, from measured inputs.

Pure arithmetic, so a test can check it and ``bench_overhead`` can print it next to
the figures it measured. Goodput is the fraction of wall time that advances training
at plain training's speed. For a system that spends ``o`` (a fraction of plain step
time) on its snapshots and loses ``W`` seconds per failure (detection and restart or
recovery, plus the work redone), with failures arriving every ``M`` seconds of wall
time on average (a Poisson process, one failure at a time):

    goodput = (1 - W / M) / (1 + o)          (0 when W >= M)

- **checkpointless** snapshots every ``n`` steps of ``t`` seconds, each snapshot adding
  ``c`` seconds (measured against plain training), so ``o = c / (n t)``. A failure
  costs the in-process recovery time ``R_cl`` plus the work since the newest committed
  step: half an interval on average, plus one step because a round commits while the
  next step runs (``n t / 2 + t``). ``n`` is what ``every_n_steps: auto`` (the default)
  picks (:func:`recovery.schedules.interval_policy.choose_interval`): Daly's optimum for the MTBF
  the runtime works with, when that is longer than the budget's shortest interval. With
  the default settings that MTBF is learnt: the observed rate of the job's failures
  (ADR 0032), which a long job knows well: ``cl_mtbf_factor`` 1 (the default) models
  that steady state; other factors model an estimate that far off (0.5: failures
  thought twice as frequent), ``None`` a runtime that uses no MTBF at all (the budget's
  interval whatever the failure rate).
- **torchrun + DCP async** saves every ``tau`` seconds at Daly's optimum for its
  measured per-save cost ``d`` (``o = d / tau``); a failure costs a full restart
  ``R_dcp`` (new processes, imports, process groups, checkpoint load) plus ``tau / 2``.

The crossover is the smallest MTBF in range above which torchrun + DCP has the higher
goodput, or None when checkpointless is ahead (or level) everywhere in range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from recovery.schedules.interval_policy import choose_interval, daly_interval_s

MINUTE, HOUR = 60.0, 3600.0
MTBF_RANGE_S = (1 * MINUTE, 24 * HOUR)


@dataclass(frozen=True)
class Measured:
    """The measured inputs (seconds)."""

    step_s: float  # plain training's step
    cl_snapshot_cost_s: float  # training time one checkpointless snapshot adds (k, kind)
    cl_round_s: float  # how long a round runs in the background
    cl_recovery_s: float  # in-process recovery: kill -> training again
    dcp_save_cost_s: float  # training time one DCP async_save adds
    dcp_restart_s: float  # torchrun full restart: kill -> training again, lost work excluded
    budget: float = 0.02
    cl_mtbf_factor: float | None = 1.0
    """The MTBF the runtime chooses for over the true one (None: it uses none)."""


def goodput(overhead: float, lost_per_failure_s: float, mtbf_s: float) -> float:
    """``(1 - W/M) / (1 + o)``, floored at 0."""
    return max(0.0, 1.0 - lost_per_failure_s / mtbf_s) / (1.0 + max(overhead, 0.0))


def checkpointless(m: Measured, mtbf_s: float) -> tuple[float, int]:
    """Goodput and the interval ``every_n_steps: auto`` picks (for the MTBF the runtime
    works with: ``mtbf_s`` times ``m.cl_mtbf_factor``)."""
    f = m.cl_mtbf_factor
    ch = choose_interval(step_s=m.step_s, snapshot_cost_s=m.cl_snapshot_cost_s,
                         budget=m.budget, round_s=m.cl_round_s,
                         recovery_s=m.cl_recovery_s, mtbf_s=None if f is None else mtbf_s * f)
    n = ch.every_n_steps
    lost = m.cl_recovery_s + n * m.step_s / 2 + m.step_s
    return goodput(max(m.cl_snapshot_cost_s, 0.0) / (n * m.step_s), lost, mtbf_s), n


def dcp(m: Measured, mtbf_s: float) -> tuple[float, float]:
    """Goodput and the save interval (seconds, whole steps, at least one step)."""
    tau = daly_interval_s(m.dcp_save_cost_s, mtbf_s, m.dcp_restart_s)
    tau = max(m.step_s, round(tau / m.step_s) * m.step_s)
    lost = m.dcp_restart_s + tau / 2
    return goodput(max(m.dcp_save_cost_s, 0.0) / tau, lost, mtbf_s), tau


def mtbf_grid(points: int = 60) -> list[float]:
    """Log-spaced MTBFs over :data:`MTBF_RANGE_S` (1 minute to 24 hours)."""
    lo, hi = (math.log(x) for x in MTBF_RANGE_S)
    return [math.exp(lo + (hi - lo) * i / (points - 1)) for i in range(points)]


def curve(m: Measured, points: int = 60) -> list[dict]:
    rows = []
    for mtbf in mtbf_grid(points):
        g_cl, n = checkpointless(m, mtbf)
        g_dcp, tau = dcp(m, mtbf)
        rows.append({"mtbf_s": mtbf, "checkpointless": g_cl, "dcp": g_dcp,
                     "cl_every_n_steps": n, "dcp_interval_s": tau})
    return rows


def crossover_mtbf_s(m: Measured, points: int = 400) -> float | None:
    """The smallest MTBF in range from which torchrun + DCP stays ahead, or None."""
    rows = curve(m, points)
    cross = None
    for r in reversed(rows):  # from 24 h down: where DCP stops being ahead
        if r["dcp"] > r["checkpointless"]:
            cross = r["mtbf_s"]
        else:
            break
    return cross


def ratio_at(m: Measured, mtbf_s: float) -> float:
    """Checkpointless goodput over torchrun + DCP's at ``mtbf_s``."""
    g_dcp = dcp(m, mtbf_s)[0]
    return checkpointless(m, mtbf_s)[0] / g_dcp if g_dcp > 0 else math.inf


def plot(m: Measured, path: str, title: str) -> None:
    """Goodput of both systems against MTBF (log axis), saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = curve(m, 200)
    x = [r["mtbf_s"] / HOUR for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [r["checkpointless"] for r in rows], label="checkpointless (auto interval)")
    ax.plot(x, [r["dcp"] for r in rows], label="torchrun + DCP async (Daly interval)")
    ax.set_xscale("log")
    ax.set_xlabel("MTBF of the job (hours)")
    ax.set_ylabel("goodput (fraction of plain training)")
    ax.axvline(3.0, color="grey", ls=":", lw=1)
    ax.text(3.0, ax.get_ylim()[0], " 3 h", color="grey", va="bottom")
    cross = crossover_mtbf_s(m)
    if cross is not None:
        ax.axvline(cross / HOUR, color="red", ls="--", lw=1, label="crossover")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
