"""``checkpoint_history.csv``: one row per save attempt and rank (like Nebula's).

Columns: ``timestamp, step, rank, tier, bytes, duration_s, throughput_MBps, status,
detail``. ``status`` is ``ok`` (this rank's files are durable), ``skipped`` (the
writer was still busy with an earlier step), ``failed`` (after every retry), ``exists``
(the step was already persisted) or ``aborted`` (the writer was closed mid-save).

On POSIX stores every rank appends to the one shared file: each row is a single
``write`` on an ``O_APPEND`` descriptor, which the kernel keeps whole, and the file is
created with its header by an atomic link so no row can precede the header. Object
stores cannot append; there rank ``r`` owns ``checkpoint_history.rank<r>.csv``
(rank 0 the plain name) and rewrites it with its rows. :func:`read_history` merges
whatever files exist.
"""

from __future__ import annotations

import csv
import io
import logging
import os
import posixpath
import time
import uuid
from dataclasses import dataclass

import fsspec

from replication.durable.format import HISTORY
from replication.durable.storage import is_posix, resolve

log = logging.getLogger("checkpointless.durable")

COLUMNS = (
    "timestamp", "step", "rank", "tier", "bytes", "duration_s", "throughput_MBps", "status",
    "detail",
)
MAX_ROWS_REWRITTEN = 10_000  # object stores: rows a rank keeps in its rewritten file


@dataclass(frozen=True)
class HistoryRow:
    timestamp: float
    step: int
    rank: int
    tier: str
    nbytes: int
    duration_s: float
    status: str
    detail: str = ""

    @property
    def throughput_MBps(self) -> float:
        return self.nbytes / self.duration_s / 1e6 if self.duration_s > 0 and self.nbytes else 0.0

    def cells(self) -> list[str]:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(self.timestamp))
        ts += f".{int(self.timestamp % 1 * 1000):03d}Z"
        return [
            ts, str(self.step), str(self.rank), self.tier, str(self.nbytes),
            f"{self.duration_s:.3f}", f"{self.throughput_MBps:.1f}", self.status,
            self.detail.replace("\n", " ")[:300],
        ]


def _csv(rows: list[list[str]]) -> bytes:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    for r in rows:
        w.writerow(r)
    return out.getvalue().encode("utf-8")


class HistoryWriter:
    """Appends this rank's rows; never raises (history must not stop a save)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, rank: int) -> None:
        self.fs, self.root, self.rank = fs, root, rank
        self.posix = is_posix(fs)
        name = HISTORY if self.posix or rank == 0 else HISTORY.replace(".csv", f".rank{rank}.csv")
        self.path = posixpath.join(root, name)
        self._rows: list[list[str]] | None = None  # object stores: rows of our own file

    def append(self, rows: list[HistoryRow]) -> None:
        if not rows:
            return
        try:
            if self.posix:
                self._append_posix(rows)
            else:
                self._rewrite(rows)
        except Exception as exc:
            log.warning("could not write %s: %r", self.path, exc)

    def _append_posix(self, rows: list[HistoryRow]) -> None:
        if not os.path.exists(self.path):
            os.makedirs(self.root, exist_ok=True)
            tmp = f"{self.path}.tmp-{uuid.uuid4().hex[:12]}"
            with open(tmp, "wb") as f:
                f.write(_csv([list(COLUMNS)]))
            try:
                os.link(tmp, self.path)  # atomic create-with-header; fails if it exists
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
        data = _csv([r.cells() for r in rows])
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def _rewrite(self, rows: list[HistoryRow]) -> None:
        if self._rows is None:
            self._rows = []
            try:
                old = self.fs.cat_file(self.path).decode("utf-8")
                self._rows = [r for r in csv.reader(io.StringIO(old)) if r][1:]
            except FileNotFoundError:
                pass
        self._rows.extend(r.cells() for r in rows)
        del self._rows[:-MAX_ROWS_REWRITTEN]
        self.fs.pipe_file(self.path, _csv([list(COLUMNS), *self._rows]))


def read_history(url: str, storage_options: dict | None = None) -> list[dict[str, str]]:
    """All history rows under ``url`` (every rank's file), sorted by time then rank."""
    fs, root = resolve(url, storage_options)
    fs.invalidate_cache(root)
    rows: list[dict[str, str]] = []
    try:
        names = fs.ls(root, detail=False)
    except FileNotFoundError:
        return []
    for name in names:
        base = posixpath.basename(name.rstrip("/"))
        if base.startswith("checkpoint_history") and base.endswith(".csv"):
            text = fs.cat_file(name).decode("utf-8", errors="replace")
            rows.extend(r for r in csv.DictReader(io.StringIO(text)) if r.get("step"))
    rows.sort(key=lambda r: (r.get("timestamp", ""), int(r.get("rank") or 0)))
    return rows
