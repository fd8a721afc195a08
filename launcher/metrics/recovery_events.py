"""This node's ranks' recoveries, read from the run's ``events.jsonl`` as it grows.

Each rank writes one ``recovery`` event per recovery it took part in, with ``timings``
split into the phases of ``recovery.generation.recovery_timeline`` (they add up to the
time from the fault to the recovered state). The scrape thread reads the file from
where it stopped last time, parses only the lines that can be recovery events, and
keeps the phases of the events of this node's ranks for the histogram: one observation
per rank and recovery.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Collection
from typing import Any

from recovery.common.events import Event
from recovery.generation.recovery_timeline import PHASES

#: Histogram bucket bounds of recovery phases, in seconds (a warm-spare recovery takes
#: a fraction of a second, a node loss with a spare node seconds, a durable fallback
#: longer).
BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_MARKER = f'"event": "{Event.RECOVERY}"'.encode()  # as EventLog writes it
CHUNK_BYTES = 4 << 20


class PhaseHistogram:
    """Cumulative bucket counts and sums of one phase, as Prometheus keeps them."""

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)  # the last bucket is +Inf
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        for i, bound in enumerate(BUCKETS):
            if seconds <= bound:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.total += seconds

    def cumulative(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, count in zip([*map(str, BUCKETS), "+Inf"], self.counts):
            running += count
            out.append((bound, running))
        return out


class RecoveryEvents:
    """Recovery phases of this node's ranks, from ``events.jsonl``; see the module doc."""

    def __init__(self, path: str, ranks: Callable[[], Collection[int]]) -> None:
        self.path = path
        self.ranks = ranks
        self._lock = threading.Lock()
        self._offset = 0
        self._partial = b""
        self.phases: dict[str, PhaseHistogram] = {p.removesuffix("_s"): PhaseHistogram()
                                                  for p in PHASES}
        self.total = PhaseHistogram()
        self.recoveries = 0  # rank-recoveries seen on this node
        self.last: dict[str, Any] | None = None

    def read(self) -> None:
        """Fold in what was appended since the last read, a chunk at a time (an agent
        that starts late in a long run's shared file reads it once, never all at once
        into memory). Never raises."""
        with self._lock:
            mine = {f"rank{r}" for r in self.ranks()}
            try:
                with open(self.path, "rb") as f:
                    if os.fstat(f.fileno()).st_size < self._offset:  # a new file
                        self._offset, self._partial = 0, b""
                    f.seek(self._offset)
                    while chunk := f.read(CHUNK_BYTES):
                        self._offset += len(chunk)
                        lines = (self._partial + chunk).split(b"\n")
                        self._partial = lines.pop()
                        for line in lines:
                            if _MARKER in line:
                                self._fold(line, mine)
            except OSError:
                return

    def _fold(self, line: bytes, mine: set[str]) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            return
        if event.get("event") != Event.RECOVERY or event.get("source") not in mine:
            return
        timings = event.get("timings") or {}
        for phase in PHASES:
            if (value := timings.get(phase)) is not None:
                self.phases[phase.removesuffix("_s")].observe(float(value))
        self.total.observe(sum(float(timings.get(p) or 0.0) for p in PHASES))
        self.recoveries += 1
        self.last = {"gen": event.get("gen"), "target_step": event.get("target_step"),
                     "live": event.get("live")}
