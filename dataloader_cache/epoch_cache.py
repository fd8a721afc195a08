"""The epoch cache: preprocessed *samples* on fast local storage (nebulgym style).

Why samples and not batches: the shuffle order changes every epoch (it is a function of
``seed + epoch``), so a batch is never seen twice, but every sample is. Caching the
output of ``dataset[i]`` (before collation) lets epoch 2 onwards skip preprocessing while
the batches stay exactly what the seed dictates. Only deterministic preprocessing should
be cached: a random augmentation in ``__getitem__`` would be frozen at its epoch-1 draw.

Files: ``<path>/<dataset fingerprint>/<index // 4096>/<index>.sample``, each one codec
frame (same safe codec, checksum and atomic temp-then-rename as the node cache). A
corrupt file is deleted, counted and recomputed.

Budget: no eviction (every epoch touches every sample, so evicting would only thrash);
samples past the budget are simply not cached. The budget is shared by all processes on
the node through ``.usage`` (bytes reserved, updated under a flock). Each process
reserves space in chunks, so the lock is taken once per chunk, not per sample; a process
that dies leaks at most its unused chunk (the accounting errs on the safe side).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from typing import Any

from .codec import CorruptEntryError, Frame, encode
from .fileio import atomic_write, file_lock, is_orphan_tmp, read_verified, remove_quietly
from .stats import Counters

log = logging.getLogger(__name__)

SHARD = 4096


class EpochSampleCache:
    """Per-index cache of preprocessed samples within a byte budget."""

    def __init__(
        self,
        path: str,
        fingerprint: str,
        budget_bytes: int = 8 << 30,
        *,
        counters: Counters | None = None,
    ) -> None:
        self.dir = os.path.join(path, fingerprint)
        self.budget_bytes = budget_bytes
        self.counters = counters if counters is not None else Counters()
        self._lock_path = os.path.join(self.dir, ".lock")
        self._usage_path = os.path.join(self.dir, ".usage")
        self._chunk = max(1 << 20, budget_bytes // 256)
        self._reserved = 0  # bytes this process reserved but has not used yet
        self._full = False
        self._tlock = threading.Lock()
        self._shards: set[int] = set()
        os.makedirs(self.dir, exist_ok=True)
        with file_lock(self._lock_path):
            if not os.path.exists(self._usage_path):
                self._write_usage(self._scan_usage())

    def path(self, index: int) -> str:
        """Where sample ``index`` lives."""
        return os.path.join(self.dir, f"{index // SHARD:05d}", f"{index}.sample")

    # ---------------------------------------------------------------- reads
    def get(self, index: int) -> tuple[bool, Any]:
        """``(True, sample)`` on a verified hit, else ``(False, None)``."""
        path = self.path(index)
        try:
            got = read_verified(path)
        except CorruptEntryError as e:
            log.warning("dataloader_cache: corrupt epoch-cache sample %s (%s); deleted", path, e)
            remove_quietly(path)
            self.counters.add("epoch_cache_corrupt")
            self.counters.add("epoch_cache_misses")
            return False, None
        if got is None:
            self.counters.add("epoch_cache_misses")
            return False, None
        self.counters.add("epoch_cache_hits")
        return True, got[0]

    # ---------------------------------------------------------------- writes
    def put(self, index: int, sample: Any) -> bool:
        """Cache a sample if the budget allows. ``TypeError`` for unsupported sample types."""
        if self._full:
            self.counters.add("epoch_cache_full")
            return False
        frame = encode(sample)
        if not self._reserve(frame.nbytes):
            self.counters.add("epoch_cache_full")
            return False
        self._write(index, frame)
        self.counters.add("epoch_cache_writes")
        return True

    def _write(self, index: int, frame: Frame) -> None:
        shard = index // SHARD
        if shard not in self._shards:
            os.makedirs(os.path.dirname(self.path(index)), exist_ok=True)
            self._shards.add(shard)
        atomic_write(self.path(index), frame)

    def _reserve(self, n: int) -> bool:
        with self._tlock:
            if self._reserved >= n:
                self._reserved -= n
                return True
            want = max(self._chunk, n) - self._reserved
            with file_lock(self._lock_path):
                used = self._read_usage()
                grant = min(want, self.budget_bytes - used)
                if grant < n - self._reserved:
                    self._full = True  # a smaller sample might still fit, but stop probing
                    return False
                self._write_usage(used + grant)
            self._reserved += grant - n
            return True

    def _read_usage(self) -> int:
        try:
            with open(self._usage_path) as f:
                return int(f.read().strip() or 0)
        except (OSError, ValueError):
            return self._scan_usage()

    def _write_usage(self, value: int) -> None:
        atomic_write(self._usage_path, f"{value}\n".encode())

    def _scan_usage(self) -> int:
        total = 0
        for dirpath, _dirs, files in os.walk(self.dir):
            for name in files:
                p = os.path.join(dirpath, name)
                try:
                    st = os.stat(p)
                except FileNotFoundError:
                    continue
                if is_orphan_tmp(name, st.st_mtime):
                    remove_quietly(p)
                elif name.endswith(".sample"):
                    total += st.st_size
        return total

    # ---------------------------------------------------------------- housekeeping
    def usage_bytes(self) -> int:
        """Bytes of samples actually on disk."""
        return sum(
            os.path.getsize(os.path.join(d, f))
            for d, _, files in os.walk(self.dir)
            for f in files
            if f.endswith(".sample")
        )

    def cleanup(self) -> None:
        """Delete this dataset's epoch cache."""
        shutil.rmtree(self.dir, ignore_errors=True)
