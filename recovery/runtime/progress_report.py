"""What a rank tells its agent about its progress: a small JSON file next to its heartbeat.

The agent serves the job's metrics (``launcher.metrics``) and judges stragglers; the
workers never open a port. So each rank writes ``<heartbeat file>.progress`` from its
watchdog thread once per heartbeat, atomically (a temporary file renamed over it), and
the agent reads it when it is scraped or judges a window.

The training thread only records the end of each step (:meth:`ProgressReport.step_done`):
two clock reads and a few list appends. Everything else (the replicator's figures, the
JSON, the file) happens on the watchdog thread, off the step.

What a step costs this rank itself, as opposed to what it waits for its peers, is its
``own`` time: the step's wall time minus the time a collective was in flight
(:mod:`recovery.process_group.inflight_clock`). A straggler's own time is long and its
waits short; its peers' are the other way round, while every rank's wall time is the
same. Each window of ``straggler_window_steps`` steps (windows end at multiples of it,
so every rank's window ``k`` covers the same steps) is reported by its medians.
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from recovery.process_group.inflight_clock import CLOCK

if TYPE_CHECKING:
    from recovery.runtime.checkpointless import Checkpointless

#: The suffix of the progress file, after the heartbeat file's name.
SUFFIX = ".progress"
#: Step durations kept for the median step time (the goodput's productive pace).
PACE_STEPS = 101
#: Closed windows a report carries, so an agent that reads it once a second misses none
#: of windows shorter than that.
WINDOWS_KEPT = 8


class ProgressReport:
    """One rank's progress, recorded by the training thread, written by the watchdog."""

    def __init__(self, path: str, rank: int, window_steps: int,
                 details: Callable[[], dict[str, Any]] = dict) -> None:
        self.path = path
        self.rank = rank
        self.window_steps = max(1, window_steps)
        self._details = details
        self._last_step = 0
        self._last_t: float | None = None
        self._last_waited = 0.0
        self._highest = 0
        self._highest_ts: float | None = None
        self._replayed = 0
        self._first: tuple[int, float] | None = None  # (step, wall time) of this process's first
        self._pace: collections.deque[float] = collections.deque(maxlen=PACE_STEPS)
        self._own: list[float] = []
        self._walls: list[float] = []
        self._windows: list[dict[str, Any]] = []  # the newest closed windows, oldest first
        self._durable_ok_step, self._durable_ok_ts = -1, None

    def step_done(self, step: int) -> None:
        """The training thread, at the end of ``step`` (cheap: no I/O, no lock)."""
        now, waited = time.monotonic(), CLOCK.total_s()
        if self._last_t is not None and step == self._last_step + 1:
            wall = now - self._last_t
            self._pace.append(wall)
            self._walls.append(wall)
            self._own.append(max(0.0, wall - (waited - self._last_waited)))
        elif step <= self._last_step:  # rolled back: the window starts again
            self._own, self._walls = [], []
        if step <= self._highest:
            self._replayed += 1
        else:
            self._highest, self._highest_ts = step, time.time()
        if self._first is None:
            self._first = (step, time.time())
        self._last_step, self._last_t, self._last_waited = step, now, waited
        if step % self.window_steps == 0:
            if len(self._own) >= self.window_steps // 2:
                window = {"index": step // self.window_steps, "end_step": step,
                          "own_s": statistics.median(self._own),
                          "step_s": statistics.median(self._walls), "steps": len(self._own)}
                self._windows = [*self._windows[-(WINDOWS_KEPT - 1):], window]
            self._own, self._walls = [], []

    def snapshot(self) -> dict[str, Any]:
        """What the file holds (the watchdog thread; a racy read of plain fields is fine:
        each is replaced whole by the training thread)."""
        pace = list(self._pace)
        record: dict[str, Any] = {
            "rank": self.rank, "pid": os.getpid(), "ts": time.time(),
            "step": self._last_step, "highest_step": self._highest,
            "highest_ts": self._highest_ts,
            "steps_replayed": self._replayed,
            "first_step": self._first[0] if self._first else None,
            "first_ts": self._first[1] if self._first else None,
            "step_s": statistics.median(pace) if pace else None,
            "windows": self._windows,
        }
        try:
            record.update(self._details())
        except Exception:  # the replicator may be between generations: report the rest
            pass
        durable = record.get("durable")
        if durable is not None:  # when this rank's newest good save was seen to finish
            if durable["newest_ok_step"] > self._durable_ok_step:
                self._durable_ok_step, self._durable_ok_ts = durable["newest_ok_step"], time.time()
            durable["newest_ok_ts"] = self._durable_ok_ts
        return record

    def write(self) -> None:
        """Replace the file (the watchdog thread, each heartbeat); never raises."""
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.snapshot(), f, default=str)
            os.replace(tmp, self.path)
        except Exception:  # the run directory may be going away with the job
            pass


def read(path: str) -> dict[str, Any] | None:
    """A progress file's record, or None (absent, or caught between writes)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def details(rt: Checkpointless) -> dict[str, Any]:
    """The runtime's own figures: generation, committed step, replicas, memory per tier."""
    from recovery.runtime import live_rollback

    out: dict[str, Any] = {"gen": rt.gen}
    rep = rt.replicator
    if rep is None:
        return out
    committed = rep.known_committed
    out["committed_step"] = committed
    out["replication_lag_steps"] = max(0, rt.step - committed) if committed >= 0 else None
    own = rep.state_bytes_of_rank[rt.rank] if rep.state_bytes_of_rank else 0
    plan = rep.plan(own)
    out["memory_bytes"] = {"snapshots": plan.own_bytes, "replicas": plan.replica_bytes,
                           "update_logs": live_rollback.log_bytes(rt),
                           "durable_staging": plan.durable_staging_bytes}
    out["state_bytes"] = own
    rnd = rep.last_round
    if rnd is not None:
        out["replica_bytes_sent"] = rnd.bytes_sent
        out["replica_bytes_received"] = rnd.bytes_received
    writer = rt.durable.writer
    last = writer.last_result if writer is not None else None
    if last is not None:  # the newest save this rank's writer finished, however it ended
        out["durable"] = {"step": last.step, "status": last.status, "bytes": last.nbytes,
                          "duration_s": last.duration_s,
                          "newest_ok_step": writer.newest_persisted_step,
                          "saves_ok": writer.stats.get("ok", 0),
                          "saves_failed": writer.stats.get("failed", 0)}
    return out


def attach(rt: Checkpointless) -> ProgressReport | None:
    """The report of ``rt``'s rank, written at each of its heartbeats; None when the
    process runs without an agent (no heartbeat file: nothing reads it)."""
    hb = rt.env.heartbeat_file
    if not hb:
        return None
    report = ProgressReport(hb + SUFFIX, rt.rank,
                            rt.settings.recovery.straggler_window_steps, lambda: details(rt))
    rt.watchdog.on_beat = report.write
    return report
