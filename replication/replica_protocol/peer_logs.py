"""The update logs a rank holds for the ranks whose replicas it keeps (ADR 0049).

A sharded job's mark carries its step's optimizer inputs
(:mod:`replication.replica_protocol.update_log`). A holder keeps, per source rank, the
unbroken run of such marks that follows the newest committed step it knows of: with
its replica of that step, it is all a replacement needs to rebuild the source's state
at the newest of them. Marks at or before the committed step are dropped as each step
commits; a gap (a mark skipped or not replayable) starts the run again at the next
mark; a run that outgrows its share of the memory budget is dropped and not extended
until the next commit (the recovery then replays, and the event says why).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from replication.replica_protocol.marks import Mark

log = logging.getLogger("checkpointless.replication")


class PeerLogs:
    """Runs of marks per source rank, under a byte bound per source."""

    def __init__(self, max_bytes: int = 1 << 62) -> None:
        self.max_bytes = max_bytes  # per source; set from the memory budget
        self._runs: dict[int, list[Mark]] = {}
        self._full: set[int] = set()  # sources whose run overflowed since the last commit
        self._floor = -1  # the newest committed step known: older marks are useless
        self._lock = threading.Lock()
        self.overflows = 0
        self._told = False
        self._mark_bytes: dict[int, int] = {}  # per source, its newest mark's size

    def append(self, src: int, mark: Mark) -> None:
        """A mark of ``src`` arrived (on a receiving thread)."""
        with self._lock:
            self._mark_bytes[src] = mark.buffer.numel()
            if mark.step <= self._floor or src in self._full:
                return
            run = self._runs.get(src, [])
            if run and run[-1].step + 1 != mark.step:
                run = []  # a gap: what came before cannot reach this mark
            if not mark.replayable:
                self._runs.pop(src, None)
                return
            run.append(mark)
            if not self._told:  # what the log costs, once: the mark's size sets it
                self._told = True
                each = mark.buffer.numel()
                log.info("update log: rank %d's marks are %.1f MiB a step; %.0f MiB of the "
                         "memory budget holds %d steps of each source", src, each / 2**20,
                         self.max_bytes / 2**20, self.max_bytes // max(1, each))
            if sum(m.buffer.numel() for m in run) > self.max_bytes:
                self._runs.pop(src, None)
                self._full.add(src)
                self.overflows += 1
                log.warning("update log of rank %d over %d bytes since step %d: dropped; "
                            "a recovery of that rank before the next commit replays",
                            src, self.max_bytes, self._floor)
                return
            self._runs[src] = run

    def committed(self, step: int) -> None:
        """``step`` committed: marks up to it are no longer needed."""
        with self._lock:
            if step <= self._floor:
                return
            self._floor = step
            self._full.clear()
            for src, run in list(self._runs.items()):
                kept = [m for m in run if m.step > step]
                if kept:
                    self._runs[src] = kept
                else:
                    del self._runs[src]

    def first_steps(self) -> dict[int, int]:
        """Per source, the first step of the run held (its last is the newest mark)."""
        with self._lock:
            return {src: run[0].step for src, run in self._runs.items() if run}

    def run(self, src: int, first: int, last: int) -> list[Mark]:
        """The marks of ``src`` from ``first`` to ``last``, each step once, in order."""
        with self._lock:
            run = list(self._runs.get(src, []))
        out = [m for m in run if first <= m.step <= last]
        if [m.step for m in out] != list(range(first, last + 1)):
            raise KeyError(f"no update log of rank {src} from step {first} to {last}")
        return out

    def steps_that_fit(self) -> int | None:
        """How many marks of every source fit in :attr:`max_bytes`, less two (a run
        also holds the marks taken while the next snapshot's round commits); ``None``
        until a mark arrived (one that overflowed counts)."""
        with self._lock:
            sizes = list(self._mark_bytes.values())
        if not sizes:
            return None
        return max(1, self.max_bytes // max(1, max(sizes)) - 2)

    def nbytes(self) -> int:
        """Bytes held, every source's run together (the memory report's figure)."""
        with self._lock:
            return sum(m.buffer.numel() for run in self._runs.values() for m in run)
