"""The node-level cache of collated batches, in shared memory, owned by the node.

Why files in ``/dev/shm`` rather than memory inside the worker: a worker that dies takes
its heap with it, but tmpfs files stay until someone deletes them. The replacement
process that takes over the dead rank on the same node (or any process on it) finds the
batches the dead one prepared, keyed by ``(fingerprint, epoch, dp_rank, step)``, and
resumes without touching the dataset. Ranks that share a data-parallel rank on a node
(tensor/pipeline parallel peers) compute the same key and share one host copy.

Layout (flat, so one ``scandir`` sees everything)::

    <root>/<fp>-e<epoch>-r<rank>-s<step>.batch   one collated batch (codec frame)
    <root>/.tmp-<pid>-...                        in-flight writes (pid identifies orphans)
    <root>/.marks/<fp>-r<rank>                    committed watermark per rank
    <root>/.lock                                  flock serialising budget accounting
    <root>/.lease                                 touched while the job writes

``root`` defaults to ``/dev/shm/checkpointless-<job_id>/batches``.

Budget: every write takes the node-wide flock, scans the directory (sizes are memoised
per inode, so a scan is one ``scandir``), and evicts until the new entry fits, so the
directory never exceeds ``size_budget_bytes`` even with many writers. Eviction order:
orphaned temp files, then entries behind their rank's committed watermark minus the
lookback window (a rollback never goes there), then the oldest entries by (epoch, step).

Lookback: recovery rolls back to the last committed step, so entries from
``committed - lookback`` onward are what a replay needs; :meth:`mark_committed` records
the watermark (for other processes' eviction decisions too) and deletes this rank's
entries behind it right away.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

from .codec import CorruptEntryError, Frame
from .fileio import (
    TMP_PREFIX,
    atomic_write,
    file_lock,
    is_orphan_tmp,
    read_verified,
    remove_quietly,
)
from .stats import Counters

log = logging.getLogger(__name__)

_ENTRY = re.compile(r"^([0-9a-f]{16})-e(\d+)-r(\d+)-s(\d+)\.batch$")
_JOB_SAFE = re.compile(r"[^A-Za-z0-9._-]")
DIR_PREFIX = "checkpointless-"
SUBDIR = "batches"
HIT, MISS, CORRUPT = "hit", "miss", "corrupt"


def default_root(job_id: str) -> str:
    """``/dev/shm/checkpointless-<job_id>/batches`` (or the temp dir without /dev/shm)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    base = base or tempfile.gettempdir()
    return os.path.join(base, DIR_PREFIX + _JOB_SAFE.sub("_", job_id), SUBDIR)


@dataclass(frozen=True, order=True)
class BatchKey:
    """Identity of one cached batch."""

    fingerprint: str
    epoch: int
    dp_rank: int
    step: int

    @property
    def name(self) -> str:
        """The entry's file name."""
        return f"{self.fingerprint}-e{self.epoch:06d}-r{self.dp_rank:05d}-s{self.step:08d}.batch"


@dataclass
class _Entry:
    name: str
    size: int
    mtime: float
    key: BatchKey | None  # None for temp files


class NodeBatchCache:
    """Collated batches in a node-shared directory, with a size budget and a lookback window.

    Safe to use from several threads and several processes at once.
    """

    def __init__(
        self,
        job_id: str,
        directory: str = "",
        size_budget_bytes: int = 1 << 30,
        lookback: int = 8,
        *,
        counters: Counters | None = None,
        stale_after_s: float = 3600.0,
    ) -> None:
        self.job_id = job_id
        self.default_layout = not directory
        self.root = directory or default_root(job_id)
        self.size_budget_bytes = size_budget_bytes
        self.lookback = lookback
        self.stale_after_s = stale_after_s
        self.counters = counters if counters is not None else Counters()
        self._lock_path = os.path.join(self.root, ".lock")
        self._marks_dir = os.path.join(self.root, ".marks")
        self._lease_path = os.path.join(self.root, ".lease")
        self._sizes: dict[tuple[str, int], tuple[int, float]] = {}
        self._tlock = threading.Lock()
        self._scan_lock = threading.Lock()
        self._own: dict[tuple[str, int], set[tuple[int, int]]] = {}
        self._last_lease = 0.0
        self._ensure_dirs()
        self._touch_lease(force=True)
        self.clean_orphans()
        if self.default_layout:
            self.clean_stale_jobs()

    # ---------------------------------------------------------------- layout helpers
    def _ensure_dirs(self) -> None:
        os.makedirs(self._marks_dir, exist_ok=True)

    def _touch_lease(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._last_lease < 10.0:
            return
        self._last_lease = now
        with contextlib.suppress(OSError), open(self._lease_path, "a"):
            os.utime(self._lease_path, None)

    def path(self, key: BatchKey) -> str:
        """Where ``key`` lives."""
        return os.path.join(self.root, key.name)

    # ---------------------------------------------------------------- reads
    def lookup(self, key: BatchKey) -> tuple[str, Any]:
        """``(HIT, batch)``, ``(MISS, None)`` or ``(CORRUPT, None)``.

        A corrupt or partial entry is deleted here, so it is recomputed and rewritten,
        and is never returned.
        """
        path = self.path(key)
        try:
            got = read_verified(path)
        except CorruptEntryError as e:
            log.warning("dataloader_cache: corrupt node-cache entry %s (%s); deleted", path, e)
            remove_quietly(path)
            self.counters.add("corrupt")
            self.counters.add("misses")
            return CORRUPT, None
        if got is None:
            self.counters.add("misses")
            return MISS, None
        self.counters.add("hits")
        with self._tlock:
            self._own.get((key.fingerprint, key.dp_rank), set()).add((key.epoch, key.step))
        return HIT, got[0]

    def get(self, key: BatchKey) -> Any | None:
        """The cached batch, or ``None`` (absent or corrupt)."""
        return self.lookup(key)[1]

    def contains(self, key: BatchKey) -> bool:
        """Whether an entry file exists (unverified; for tests and warm-up decisions)."""
        return os.path.exists(self.path(key))

    # ---------------------------------------------------------------- writes
    def put(self, key: BatchKey, frame: Frame | bytes | bytearray) -> bool:
        """Store an encoded batch atomically within the budget. ``False`` if not stored."""
        nbytes = frame.nbytes if isinstance(frame, Frame) else len(frame)
        if nbytes > self.size_budget_bytes:
            self.counters.add("write_skipped")
            return False
        for attempt in range(2):
            try:
                stored = self._put_locked(key, frame, nbytes)
                break
            except FileNotFoundError:  # directory removed under us (cleanup by someone else)
                if attempt:
                    raise
                self._ensure_dirs()
        if not stored:
            self.counters.add("write_skipped")
            return False
        self.counters.add("writes")
        with self._tlock:
            self._own.setdefault((key.fingerprint, key.dp_rank), set()).add((key.epoch, key.step))
        self._touch_lease()
        return True

    def _put_locked(self, key: BatchKey, frame: Frame | bytes | bytearray, nbytes: int) -> bool:
        with file_lock(self._lock_path):
            entries = self._scan()
            used = sum(e.size for e in entries)
            existing = next((e for e in entries if e.name == key.name), None)
            if existing is not None:
                used -= existing.size
            if used + nbytes > self.size_budget_bytes:
                for victim in self._eviction_order(entries, keep=key.name):
                    if used + nbytes <= self.size_budget_bytes:
                        break
                    if remove_quietly(os.path.join(self.root, victim.name)):
                        self.counters.add("evicted")
                    used -= victim.size
                if used + nbytes > self.size_budget_bytes:
                    return False  # the rest is other writers' in-flight temp files
            atomic_write(self.path(key), frame)
            return True

    def _scan(self) -> list[_Entry]:
        """Entries and temp files with their sizes (memoised per inode: files are immutable)."""
        with self._scan_lock:
            return self._scan_unlocked()

    def _scan_unlocked(self) -> list[_Entry]:
        out: list[_Entry] = []
        seen: set[tuple[str, int]] = set()
        with os.scandir(self.root) as it:
            for d in it:
                name = d.name
                m = _ENTRY.match(name)
                if m is None and not name.startswith(TMP_PREFIX):
                    continue
                memo_key = (name, d.inode())
                info = self._sizes.get(memo_key)
                if info is None or m is None:  # temp files grow while written: always stat
                    try:
                        st = d.stat()
                    except FileNotFoundError:
                        continue
                    info = (st.st_size, st.st_mtime)
                    if m is not None:
                        self._sizes[memo_key] = info
                seen.add(memo_key)
                key = None
                if m is not None:
                    key = BatchKey(m[1], int(m[2]), int(m[3]), int(m[4]))
                out.append(_Entry(name, info[0], info[1], key))
        for k in [k for k in self._sizes if k not in seen]:
            del self._sizes[k]
        return out

    def _read_marks(self) -> dict[tuple[str, int], tuple[int, int]]:
        marks: dict[tuple[str, int], tuple[int, int]] = {}
        try:
            names = os.listdir(self._marks_dir)
        except FileNotFoundError:
            return marks
        for name in names:
            fp, _, rank = name.partition("-r")
            try:
                with open(os.path.join(self._marks_dir, name)) as f:
                    epoch, step = (int(x) for x in f.read().split())
                marks[(fp, int(rank))] = (epoch, step)
            except (OSError, ValueError):
                continue
        return marks

    def _eviction_order(self, entries: list[_Entry], keep: str) -> list[_Entry]:
        """Least useful first: orphan temp files, entries behind the window, then oldest."""
        marks = self._read_marks()
        ranked: list[tuple[tuple[Any, ...], _Entry]] = []
        for e in entries:
            if e.name == keep:
                continue
            if e.key is None:
                if is_orphan_tmp(e.name, e.mtime):
                    ranked.append(((0,), e))
                continue  # a live writer's temp file is not ours to delete
            k = e.key
            mark = marks.get((k.fingerprint, k.dp_rank))
            stale = mark is not None and (k.epoch, k.step) < mark
            ranked.append(((1 if stale else 2, k.epoch, k.step, e.mtime), e))
        ranked.sort(key=lambda r: r[0])
        return [e for _, e in ranked]

    # ---------------------------------------------------------------- lookback window
    def mark_committed(self, fingerprint: str, dp_rank: int, epoch: int, step: int) -> int:
        """Record that (epoch, step) is committed; drop this rank's entries behind the window.

        ``step`` is the loader position of the committed state (the next batch to hand
        out). Entries from ``step - lookback`` onward are kept so a rollback replays from
        the cache. Returns the number of entries deleted.
        """
        keep_from = (epoch, max(0, step - self.lookback))
        mark = os.path.join(self._marks_dir, f"{fingerprint}-r{dp_rank}")
        try:
            atomic_write(mark, f"{keep_from[0]} {keep_from[1]}\n".encode())
        except FileNotFoundError:
            self._ensure_dirs()
            atomic_write(mark, f"{keep_from[0]} {keep_from[1]}\n".encode())
        own_key = (fingerprint, dp_rank)
        with self._tlock:
            own = self._own.get(own_key)
            if own is None:
                own = self._own[own_key] = self._scan_own(fingerprint, dp_rank)
            behind = [p for p in own if p < keep_from]
            own.difference_update(behind)
        removed = 0
        for e, s in behind:
            if remove_quietly(self.path(BatchKey(fingerprint, e, dp_rank, s))):
                removed += 1
        if removed:
            self.counters.add("evicted", removed)
        self._touch_lease()
        return removed

    def _scan_own(self, fingerprint: str, dp_rank: int) -> set[tuple[int, int]]:
        out = set()
        for name in os.listdir(self.root):
            m = _ENTRY.match(name)
            if m and m[1] == fingerprint and int(m[3]) == dp_rank:
                out.add((int(m[2]), int(m[4])))
        return out

    # ---------------------------------------------------------------- housekeeping
    def usage_bytes(self) -> int:
        """Bytes currently held by entries and in-flight writes."""
        return sum(e.size for e in self._scan())

    def list_keys(self) -> list[BatchKey]:
        """All complete entries, sorted."""
        return sorted(e.key for e in self._scan() if e.key is not None)

    def clean_orphans(self) -> int:
        """Delete temp files left by writers that died mid-write."""
        removed = 0
        with os.scandir(self.root) as it:
            for d in it:
                if d.name.startswith(TMP_PREFIX):
                    try:
                        mtime = d.stat().st_mtime
                    except FileNotFoundError:
                        continue
                    if is_orphan_tmp(d.name, mtime) and remove_quietly(d.path):
                        removed += 1
        return removed

    def clean_stale_jobs(self) -> list[str]:
        """Remove other jobs' caches on this node whose lease is older than ``stale_after_s``.

        Only the default layout is scanned (``/dev/shm/checkpointless-*``): a job that is
        still running touches its lease at least every few seconds while it writes, so
        only abandoned caches (crashed jobs, runs that never called cleanup) go.
        """
        job_dir = os.path.dirname(self.root)
        parent = os.path.dirname(job_dir)
        removed = []
        now = time.time()
        try:
            names = os.listdir(parent)
        except OSError:
            return removed
        for name in names:
            other = os.path.join(parent, name)
            if not name.startswith(DIR_PREFIX) or other == job_dir:
                continue
            batches = os.path.join(other, SUBDIR)
            lease = os.path.join(batches, ".lease")
            try:
                age = now - os.stat(lease if os.path.exists(lease) else batches).st_mtime
            except OSError:
                continue
            if age > self.stale_after_s:
                shutil.rmtree(batches, ignore_errors=True)
                with contextlib.suppress(OSError):
                    os.rmdir(other)  # only if nothing else of that job lives there
                removed.append(other)
                log.info("dataloader_cache: removed stale cache of another job: %s", other)
        return removed

    def cleanup(self) -> None:
        """Delete this job's cache on this node (call once, from the owner, at run end).

        Under the default layout the whole ``.../batches`` directory goes (and the job
        directory if nothing else lives in it). A user-configured directory may hold
        other things, so there only the files this cache creates are removed.
        """
        if self.default_layout:
            shutil.rmtree(self.root, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(self.root))
            return
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return
        for name in names:
            if _ENTRY.match(name) or name.startswith(TMP_PREFIX) or name in (".lock", ".lease"):
                remove_quietly(os.path.join(self.root, name))
        shutil.rmtree(self._marks_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(self.root)
