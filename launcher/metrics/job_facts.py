"""The job store's view of the job, for the metrics: read by the agent's own loop.

The store connection belongs to the agent's loop (a TCPStore client is not for two
threads), so the loop calls :meth:`JobFacts.refresh` every few seconds and the
scrape thread reads the figures it left. Each refresh reads what is new only: the
cause records of generations not yet seen and the failure records past the last
counted, so its cost does not grow with the job's history.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import torch.distributed as dist

from recovery.common.causes import CONSEQUENTIAL
from recovery.generation import protocol
from replication.replica_protocol.commit import committed_step

#: The loop refreshes the facts at most this often (a scrape is every 15 s by default;
#: each refresh is 3-4 store reads per agent, on the store node 0 hosts).
REFRESH_S = 5.0


class JobFacts:
    """Generation, committed step, failures and generations by cause; see the module doc."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next_refresh = 0.0
        self.generation = 0
        self.committed_step = -1
        self.failures = 0
        self.generations_by_cause: collections.Counter[str] = collections.Counter()
        self.failures_by_cause: collections.Counter[str] = collections.Counter()
        self.fatal: str | None = None
        self._causes_read = 0

    def refresh(self, store: dist.Store, gen: int) -> None:
        """The agent's loop, with the generation it has just read; at most every
        :data:`REFRESH_S`. Never raises: a store that does not answer leaves the last
        figures (the loop has its own way of noticing)."""
        now = time.monotonic()
        if now < self._next_refresh:
            return
        self._next_refresh = now + REFRESH_S
        try:
            causes = []
            for g in range(self._causes_read + 1, gen + 1):
                cause = protocol.read_json(store, protocol.cause_key(g)) or {}
                causes.append(str(cause.get("kind") or "unknown"))
            failures, kinds = self.failures, []
            while (record := protocol.failure_record(store, failures + 1)) is not None:
                failures += 1
                kinds.append(str(record.get("kind") or "unknown"))
            committed = committed_step(store)
            fatal = protocol.fatal(store)
        except Exception:
            return
        with self._lock:
            self.generation = max(self.generation, gen)
            self._causes_read = max(self._causes_read, gen)
            self.generations_by_cause.update(causes)
            self.failures = failures
            self.failures_by_cause.update(kinds)
            self.committed_step = max(self.committed_step, committed)
            self.fatal = None if fatal is None else str(fatal.get("reason"))

    def figures(self) -> dict[str, Any]:
        """A consistent copy for one scrape."""
        with self._lock:
            return {"generation": self.generation, "committed_step": self.committed_step,
                    "failures": self.failures,
                    "generations_by_cause": dict(self.generations_by_cause),
                    "failures_by_cause": dict(self.failures_by_cause),
                    "fatal": self.fatal}


def is_failure_cause(kind: str) -> bool:
    """A generation's cause that is a failure of its own, not the consequence of one."""
    return kind not in {str(c) for c in CONSEQUENTIAL}
