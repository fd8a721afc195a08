"""This node's ranks as their progress files report them, and the node's goodput.

Each rank writes ``<heartbeat>.progress`` once per heartbeat
(:mod:`recovery.runtime.progress_report`). The scrape thread reads the files of the
ranks the agent runs now and keeps, across processes (a replacement starts its own
counts), what must outlive one: where this node's training began and how many steps
its ranks replayed.

**Goodput**, live, as the chaos soak defines it (productive step time over wall time,
``launcher.chaos.metrics``): the productive time is the steps gained since this node's
first completed step, each at the failure-free pace (the median step time of the last
hundred steps), over the wall time between that first step and the newest one. Steps
replayed after a rollback gain nothing, and the time a failure costs (detection,
recovery, replay, slower steps after it) is the difference from 1. It is this node's
view: a spare node that took ranks over counts from its own first step.
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from recovery.runtime.progress_report import read


@dataclass
class _Start:
    step: int
    ts: float


@dataclass
class NodeProgress:
    """Reads this node's progress files; see the module doc."""

    paths: Callable[[], Mapping[int, str]]  # rank -> its progress file, the ranks run now
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _start: _Start | None = None
    _highest: tuple[int, float] = (0, 0.0)  # (step, when it completed)
    _replayed_base: dict[int, int] = field(default_factory=dict)  # rank -> earlier processes'
    _replayed_seen: dict[tuple[int, int], int] = field(default_factory=dict)  # (rank, pid)

    def read(self) -> dict[int, dict[str, Any]]:
        """Each current rank's newest record (a rank between writes keeps its last)."""
        records = {}
        for rank, path in dict(self.paths()).items():
            rec = read(path)
            if rec is not None:
                records[rank] = rec
        with self._lock:
            for rank, rec in records.items():
                self._fold(rank, rec)
        return records

    def _fold(self, rank: int, rec: Mapping[str, Any]) -> None:
        if rec.get("first_ts") is not None and rec.get("first_step") is not None:
            start = _Start(int(rec["first_step"]), float(rec["first_ts"]))
            if self._start is None or start.ts < self._start.ts:
                self._start = start
        highest, ts = int(rec.get("highest_step") or 0), rec.get("highest_ts")
        if ts is not None and highest > self._highest[0]:
            self._highest = (highest, float(ts))
        key, replayed = (rank, int(rec.get("pid") or 0)), int(rec.get("steps_replayed") or 0)
        if key not in self._replayed_seen:  # a new process of this rank: bank the old one's
            old = [v for (r, _pid), v in self._replayed_seen.items() if r == rank]
            self._replayed_base[rank] = self._replayed_base.get(rank, 0) + sum(old)
            for k in [k for k in self._replayed_seen if k[0] == rank]:
                del self._replayed_seen[k]
        self._replayed_seen[key] = replayed

    def steps_replayed(self) -> int:
        """Steps this node's ranks ran again after rollbacks (the most any rank did: each
        rank replays the same steps)."""
        with self._lock:
            ranks = set(self._replayed_base) | {r for r, _ in self._replayed_seen}
            per_rank = [self._replayed_base.get(r, 0) + sum(
                v for (rr, _), v in self._replayed_seen.items() if rr == r) for r in ranks]
        return max(per_rank, default=0)

    def goodput(self, records: Mapping[int, Mapping[str, Any]]) -> float | None:
        """This node's goodput so far (module doc); None before two steps completed."""
        paces = [float(r["step_s"]) for r in records.values() if r.get("step_s")]
        with self._lock:
            start, (highest, ts) = self._start, self._highest
        if start is None or not paces or highest <= start.step or ts <= start.ts:
            return None
        productive = (highest - start.step) * statistics.median(paces)
        return min(1.0, productive / (ts - start.ts))
