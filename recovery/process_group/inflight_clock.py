"""How long this process has had a collective of its owned groups in flight.

Straggler detection needs each rank's *own* share of a step: the part spent computing,
loading data or stalled, as opposed to waiting in a collective for slower peers. In a
synchronous job every rank's step takes the same wall time (the all-reduce makes them
wait for one another), so wall time cannot name the slow rank; the time each rank waits
in collectives can. The fast ranks wait for the straggler, the straggler hardly waits.

Every operation of an :class:`~recovery.process_group.owned_group.ElasticProcessGroup`
starts the clock when none was in flight and stops it when the last one in flight ends
(succeeded, failed or aborted), so overlapping operations (DDP's buckets, FSDP's
prefetches) are counted once. Two ``time.monotonic()`` reads per transition, under a
lock the group already takes: nothing measurable on the step.
"""

from __future__ import annotations

import threading
import time


class InflightClock:
    """Seconds during which at least one collective was in flight (a union of intervals)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = 0
        self._since = 0.0
        self._total = 0.0
        self.operations = 0  # operations begun (the metrics benchmark's per-step count)

    def begin(self) -> None:
        """One more operation in flight."""
        with self._lock:
            self.operations += 1
            if self._open == 0:
                self._since = time.monotonic()
            self._open += 1

    def end(self, count: int = 1) -> None:
        """``count`` operations ended (a failure ends every pending one at once)."""
        if count <= 0:
            return
        with self._lock:
            if self._open == 0:
                return
            self._open = max(0, self._open - count)
            if self._open == 0:
                self._total += time.monotonic() - self._since

    def total_s(self) -> float:
        """The in-flight seconds so far, the current interval included."""
        with self._lock:
            if self._open:
                return self._total + time.monotonic() - self._since
            return self._total


#: The process's clock: every owned group counts into it (sub-groups of a mesh included).
CLOCK = InflightClock()
