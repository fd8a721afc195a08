"""Thread-safe event counters, so tests and dashboards assert on events, not timing."""

from __future__ import annotations

import threading
from collections.abc import Mapping

COUNTERS = (
    "batches_served",  # batches handed to the caller
    "hits",  # node-cache lookups that returned a verified entry
    "misses",  # node-cache lookups that found nothing usable (absent or corrupt)
    "computed",  # batches built from the dataset
    "recomputed",  # batches rebuilt because their cache entry was corrupt
    "corrupt",  # corrupt node-cache entries detected (and deleted)
    "evicted",  # node-cache entries this process evicted (budget or lookback window)
    "writes",  # node-cache entries written
    "write_skipped",  # node-cache writes skipped (entry larger than the whole budget)
    "samples_loaded",  # dataset __getitem__ calls / iterable elements consumed
    "epoch_cache_hits",
    "epoch_cache_misses",
    "epoch_cache_writes",
    "epoch_cache_corrupt",
    "epoch_cache_full",  # samples not written because the epoch-cache budget is used up
)


class Counters:
    """A fixed set of integer counters behind one lock (updated from prefetch threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(COUNTERS, 0)

    def add(self, name: str, n: int = 1) -> None:
        """Increment one counter."""
        with self._lock:
            self._values[name] += n

    def merge(self, delta: Mapping[str, int]) -> None:
        """Add counts reported by a worker process."""
        with self._lock:
            for k, v in delta.items():
                self._values[k] += v

    def snapshot(self) -> dict[str, int]:
        """A copy of all counters."""
        with self._lock:
            return dict(self._values)

    def reset(self) -> None:
        """Zero every counter."""
        with self._lock:
            for k in self._values:
                self._values[k] = 0
