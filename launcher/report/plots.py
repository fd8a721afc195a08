"""The report's figures, drawn with matplotlib's Agg renderer into PNG bytes.

matplotlib is imported inside each function, so importing this module (and running
``checkpointless --help``) costs nothing. Figures are built with the object API
(``matplotlib.figure.Figure``), never pyplot, so no global backend or figure state is
touched. Every x axis is seconds since the run's first event.
"""

from __future__ import annotations

import base64
import io
from typing import Any

from launcher.report.checkpoints import Checkpoints
from launcher.report.model import PHASE_LABELS, PHASES, Run

PHASE_COLORS = {"detect_s": "#e15759", "abort_s": "#f28e2b", "rendezvous_s": "#edc948",
                "transfer_s": "#4e79a7", "first_step_s": "#59a14f"}
LANES = ("steps", "snapshots", "replicated", "persisted", "workers", "failures", "recovery")
_MAX_LABELS = 14  # text labels on the failure lane before it becomes unreadable


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    return fig, fig.add_subplot()


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


def training_window(run: Run) -> tuple[float, float] | None:
    """(start, end) in run seconds around the steps and failures; None without steps."""
    if not run.steps:
        return None
    times = [t for t, _, _ in run.steps] + [f.failed_at for f in run.failures]
    times += [f.resumed_at or f.recovered_at or f.failed_at for f in run.failures]
    lo, hi = min(times) - run.t0, max(times) - run.t0
    pad = max(0.05 * (hi - lo), 0.2)
    return max(0.0, lo - pad), hi + pad


def timeline(run: Run, ckpts: Checkpoints) -> bytes:
    """One lane per kind of event, failures and recovery phases on the same clock.

    When training took a small part of the run (a long start-up, or a long tail of
    durable saves), a second panel zooms in on the steps and failures.
    """
    from matplotlib.figure import Figure

    window = training_window(run)
    zoom = window is not None and (window[1] - window[0]) < 0.6 * run.duration_s
    fig = Figure(figsize=(11, 7.4 if zoom else 4.2), dpi=100, layout="constrained")
    axes = fig.subplots(2, 1) if zoom else [fig.add_subplot()]
    for i, ax in enumerate(axes):
        _lanes(ax, run, ckpts, labels=i == len(axes) - 1)
        ax.set_xlim(0, max(run.duration_s, 1e-3) * 1.01)
    if zoom:
        assert window is not None
        axes[0].set_title("the whole run", fontsize=9, loc="left")
        axes[1].set_xlim(*window)
        axes[1].set_title("zoomed in on training (steps and failures)", fontsize=9, loc="left")
    _phase_legend(fig, "recovery phases:")
    return _png(fig)


def _lanes(ax: Any, run: Run, ckpts: Checkpoints, *, labels: bool) -> None:
    y = {lane: len(LANES) - 1 - i for i, lane in enumerate(LANES)}
    rel = lambda ts: ts - run.t0  # noqa: E731
    if run.steps:
        ax.scatter([rel(t) for t, _, _ in run.steps], [y["steps"]] * len(run.steps),
                   marker="|", s=120, color="#555555", linewidths=1)
        snaps = [rel(t) for t, _, stall in run.steps if stall is not None]
        ax.scatter(snaps, [y["snapshots"]] * len(snaps), marker="|", s=120, color="#4e79a7")
    reps = [rel(t) for t, _ in run.replications]
    ax.scatter(reps, [y["replicated"]] * len(reps), marker="|", s=120, color="#76b7b2")
    for row in ckpts.rows:
        color = ("#59a14f" if row.ok else "#edc948" if row.ranks_ok
                 else "#bab0ac" if "skipped" in row.status else "#e15759")
        start, width = rel(row.started_at), max(row.finished_at - row.started_at, 0.05)
        ax.broken_barh([(start, width)], (y["persisted"] - 0.3, 0.6), color=color, alpha=0.8)
    workers = [m for m in run.marks if m[1] == "workers"]
    ax.scatter([rel(t) for t, _, _ in workers], [y["workers"]] * len(workers), marker="^",
               color="#9c755f", s=30)
    fails = [m for m in run.marks if m[1] == "failures"]
    ax.scatter([rel(t) for t, _, _ in fails], [y["failures"]] * len(fails), marker="X",
               color="#d62728", s=70, zorder=3)
    if labels:
        for i, (t, _, label) in enumerate(fails[:_MAX_LABELS]):
            ax.annotate(label, (rel(t), y["failures"]), xytext=(4, 7 if i % 2 == 0 else -12),
                        textcoords="offset points", fontsize=7, color="#a01010",
                        annotation_clip=True)
    for f in run.recoveries:
        start = rel(f.failed_at)
        for phase in PHASES:
            width = f.phases.get(phase, 0.0)
            if width > 0:
                ax.broken_barh([(start, width)], (y["recovery"] - 0.35, 0.7),
                               color=PHASE_COLORS[phase])
            start += width
    ax.set_yticks([y[lane] for lane in LANES], LANES)
    ax.set_ylim(-0.7, len(LANES) - 0.3)
    ax.set_xlabel("seconds since the run started")
    ax.grid(axis="x", alpha=0.3)


def throughput(run: Run) -> bytes:
    """Steps completed per second (rank 0's ``step`` events), failures shaded."""
    fig, ax = _figure(11, 3.0)
    times = [t - run.t0 for t, _, _ in run.steps]
    if len(times) >= 2:
        # Rate over the last k steps at each step: a gap (a recovery) shows as a dip,
        # and k grows with the run so long runs are not all noise.
        k = max(1, min(50, len(times) // 25))
        xs = times[k:]
        rates = [k / max(times[i] - times[i - k], 1e-6) for i in range(k, len(times))]
        ax.plot(xs, rates, color="#4e79a7", drawstyle="steps-pre",  # holds since the step before
                marker="." if len(xs) < 80 else None,
                label=f"steps/s (over the last {k} step{'s' if k > 1 else ''})")
        mean = (len(times) - 1) / max(times[-1] - times[0], 1e-6)
        ax.axhline(mean, color="#555555", linestyle="--", linewidth=1,
                   label=f"mean {mean:.2f} steps/s")
    else:
        ax.text(0.5, 0.5, "fewer than two steps recorded", transform=ax.transAxes,
                ha="center", va="center")
    for i, f in enumerate(run.failures):
        end = f.resumed_at or f.recovered_at or run.t_end
        ax.axvspan(f.failed_at - run.t0, end - run.t0, color="#e15759", alpha=0.2,
                   label="failure -> first step after recovery" if i == 0 else None)
    window = training_window(run)
    ax.set_xlim(*(window or (0, max(run.duration_s, 1e-3) * 1.01)))
    ax.set_ylim(bottom=0)
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("steps / s")
    ax.grid(alpha=0.3)
    fig.legend(loc="outside upper center", ncols=3, fontsize=8, frameon=False)
    return _png(fig)


def recovery_phases(run: Run) -> bytes | None:
    """One stacked horizontal bar per recovery; None when the run had none."""
    recs = run.recoveries
    if not recs:
        return None
    fig, ax = _figure(11, 1.4 + 0.45 * len(recs))
    labels = []
    for i, f in enumerate(recs):
        left = 0.0
        for phase in PHASES:
            width = f.phases.get(phase, 0.0)
            ax.barh(i, width, left=left, color=PHASE_COLORS[phase], height=0.6)
            left += width
        ax.text(left, i, f" {left:.2f} s", va="center", fontsize=8)
        what = (f.what or ["?"])[0]
        labels.append(f"gen {f.gens_text}: {what[:45]}")
    ax.set_yticks(range(len(recs)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (failure -> first step completed after the recovery)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_xlim(0, max(f.recovery_s or 0.0 for f in recs) * 1.15 + 1e-3)
    _phase_legend(fig, "")
    return _png(fig)


def _phase_legend(fig: Any, title: str) -> None:
    """The phase colours, above the axes (never over the data)."""
    from matplotlib.patches import Patch

    handles = [Patch(color=PHASE_COLORS[p], label=PHASE_LABELS[p]) for p in PHASES]
    if title:
        handles.insert(0, Patch(color="none", label=title))
    fig.legend(handles=handles, loc="outside upper center", ncols=len(handles), fontsize=8,
               frameon=False)
