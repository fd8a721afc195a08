"""Compare the replay of a step after a rollback with its first run, segment by segment.

A survivor rolls back to the committed step and runs the steps after it again. If
every piece of state that shapes a step is registered with the runtime, the replay is
bit-identical to the first run, and so are the snapshot digests of each replayed step.
When they differ, something the runtime does not know about changed in between (a
batch fetched ahead of the step, as nanoGPT does; a counter on the model object; a
Python-level RNG) or the step is not deterministic, and the run goes on silently on a
different trajectory: 46 of 61 tensors of an adapted nanoGPT ended different after a
recovery that "succeeded". No other system checks this: it makes bit-identity a
run-time check instead of a test-time claim. The digests are the ones each snapshot
already has (``SnapshotMeta.digests``), so the check costs a dict per kept step.
"""

from __future__ import annotations

import threading

#: Steps whose digests are kept (the replay window is the steps after the commit).
KEEP_STEPS = 16


class ReplayCheck:
    """Digests of recent snapshots; a replayed step's are compared with its first run's."""

    def __init__(self, keep: int = KEEP_STEPS) -> None:
        self._keep = keep
        self._seen: dict[int, dict[str, str]] = {}
        self._replay: set[int] = set()
        self._found: list[tuple[int, list[str]]] = []
        self._lock = threading.Lock()

    def record(self, step: int, digests: dict[str, str],
               exempt: frozenset[str] = frozenset()) -> None:
        """A sealed snapshot of ``step`` (called for every capture, on any thread);
        entries in ``exempt`` may differ in a replay by design and are not compared."""
        with self._lock:
            if step in self._replay:
                self._replay.discard(step)
                before = self._seen.get(step, {})
                differ = sorted(n for n in set(before) | set(digests)
                                if n not in exempt and before.get(n) != digests.get(n))
                if differ:
                    self._found.append((step, differ))
            self._seen[step] = dict(digests)
            for old in sorted(self._seen)[: max(0, len(self._seen) - self._keep)]:
                del self._seen[old]

    def rolled_back(self, target_step: int) -> None:
        """The state went back to ``target_step``: the steps after it that were
        snapshotted before are replays from now on."""
        with self._lock:
            self._replay = {s for s in self._seen if s > target_step}

    def take_differences(self) -> list[tuple[int, list[str]]]:
        """Replayed steps that differed since the last call: (step, segment names)."""
        with self._lock:
            found, self._found = self._found, []
        return found
