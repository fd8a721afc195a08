"""Logged rows reach the loggers once, when the step that produced them is committed.

After a failure the job replays the steps since the last committed one. If rank 0's
loggers had already written those steps' rows, the replay would write them again (a
CSV with duplicated steps); if rank 0 died, the rows it held in memory would be lost.
So the strategy holds every ``log_metrics`` call of rank 0 in a :class:`LoggerGate`,
tagged with the step being trained, and releases a row only when its step is committed
(then the logger is asked to ``save``, so a released row is on disk):

- at a snapshot boundary, rows of steps up to the previous (now committed) snapshot are
  released, and the rows still held travel *in* the snapshot;
- after a recovery to step ``t``, the rows held for steps after ``t`` are dropped (the
  replay logs them again), and the rows the restored snapshot carries are released,
  minus those this gate (or, for a replacement rank 0, the marker file in the logger's
  directory) says were released already.

Logger versions travel in the snapshot too, so a replacement rank 0 writes into the same
``version_N`` directory, and a ``CSVLogger``'s ``metrics.csv`` is continued, not replaced.

The marker is also a sealed record in the job store (``protocol.LOGGED_KEY``), written
by rank 0 after each release: a replacement rank 0 on another node cannot read a marker
file on the old node's disk, and a logger without a local ``log_dir`` (W&B, MLflow, any
remote logger) has no file at all; the store record covers both, so the replacement does
not write its predecessor's last committed rows a second time. One store write per
release, on rank 0. What this does not cover: a process killed between a logger's
``save`` and the marker's update leaves those rows to be written again.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("checkpointless.lightning")

#: File in a logger's ``log_dir``: the newest step whose rows were released.
MARKER = ".checkpointless_logged"
_ATTR = "_checkpointless_gate"


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value


class LoggerGate:
    """Holds rank 0's logged rows until their step commits (see the module docstring)."""

    def __init__(self, current_step: Callable[[], int]) -> None:
        self._current_step = current_step
        self._loggers: list[Any] = []
        self._originals: list[Callable[..., Any]] = []
        self._rows: list[tuple[int, int, dict[str, Any], int | None]] = []
        self.released_through = -1
        self.open = False  # pass-through once training is over
        #: (read, write) of the marker in the job store, for loggers without a local
        #: directory (see the module docstring); set by :meth:`use_store`.
        self._remote: tuple[Callable[[], int | None], Callable[[int], None]] | None = None

    def use_store(self, read: Callable[[], int | None], write: Callable[[int], None]) -> None:
        """Keep the marker in the job store too (see the module docstring)."""
        self._remote = (read, write)
        if self._loggers:
            self._read_marker()

    # -- installation ---------------------------------------------------------------------
    def install(self, loggers: list[Any]) -> None:
        """Route each logger's ``log_metrics`` through the gate (idempotent)."""
        for logger in loggers:
            if getattr(logger, _ATTR, None) is self:
                continue
            index = len(self._loggers)
            self._loggers.append(logger)
            self._originals.append(logger.log_metrics)
            logger.log_metrics = self._holder(index)
            setattr(logger, _ATTR, self)
        self._read_marker()

    def _holder(self, index: int) -> Callable[..., None]:
        def log_metrics(metrics: dict[str, Any], step: int | None = None) -> None:
            if self.open:
                self._originals[index](metrics, step)
                return
            row = {k: _plain(v) for k, v in metrics.items()}
            self._rows.append((index, self._current_step(), row, step))
        return log_metrics

    # -- the commit protocol ------------------------------------------------------------------
    @property
    def holding(self) -> bool:
        return bool(self._rows)

    def release(self, through: int) -> None:
        """Write the rows of steps ``<= through`` (committed) and save the loggers."""
        ready = [r for r in self._rows if r[1] <= through]
        if not ready:
            return
        self._rows = [r for r in self._rows if r[1] > through]
        self._write(ready)
        self._mark(max(r[1] for r in ready))

    def _write(self, rows: list[tuple[int, int, dict[str, Any], int | None]]) -> None:
        touched = set()
        for index, _tag, row, step in rows:
            self._originals[index](row, step)
            touched.add(index)
        for index in sorted(touched):
            self._loggers[index].save()

    def finish(self) -> None:
        """Training is over and committed: release everything, then pass through."""
        self.release(float("inf"))  # type: ignore[arg-type]
        self.open = True

    def snapshot(self) -> dict[str, Any]:
        """The rows still held and the loggers' versions, for the next snapshot."""
        return {
            "rows": [[i, tag, row, step] for i, tag, row, step in self._rows],
            "versions": [getattr(lg, "_version", None) for lg in self._loggers],
        }

    def restore(self, saved: dict[str, Any], target: int) -> None:
        """After a recovery to ``target``: drop this attempt's rows, release the
        restored snapshot's rows that were not released yet."""
        self._rows = [(int(i), int(tag), dict(row), step) for i, tag, row, step in saved["rows"]
                      if int(tag) > self.released_through and int(i) < len(self._loggers)]
        self.release(target)

    # -- logger versions (called before Lightning resolves any log directory) ----------------
    @staticmethod
    def pin_versions(loggers: list[Any], saved: dict[str, Any] | None) -> None:
        """Make a replacement's loggers use the directories of the run they continue."""
        if not saved:
            return
        for logger, version in zip(loggers, saved.get("versions", [])):
            if version is not None and getattr(logger, "_version", "absent") is None:
                logger._version = version
                _continue_csv(logger)

    # -- the marker file ---------------------------------------------------------------------
    def _marker_path(self) -> str | None:
        for logger in self._loggers:
            log_dir = getattr(logger, "log_dir", None)
            if isinstance(log_dir, str) and "://" not in log_dir:
                return os.path.join(log_dir, MARKER)
        return None

    def _read_marker(self) -> None:
        if self._remote is not None and (stored := self._remote[0]()) is not None:
            self.released_through = max(self.released_through, stored)
        path = self._marker_path()
        if path and os.path.isfile(path):
            try:
                with open(path) as f:
                    self.released_through = max(self.released_through, int(f.read().strip()))
            except (OSError, ValueError):
                log.warning("unreadable %s; logged rows may be written twice after a "
                            "recovery", path)

    def _mark(self, step: int) -> None:
        self.released_through = max(self.released_through, step)
        if self._remote is not None:
            self._remote[1](self.released_through)
        path = self._marker_path()
        if path is None:
            return
        tmp = f"{path}.tmp"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w") as f:
            f.write(str(self.released_through))
        os.replace(tmp, path)


def _continue_csv(logger: Any) -> None:
    """Open a ``CSVLogger``'s writer on an existing ``metrics.csv`` without replacing it.

    Lightning's writer deletes an existing ``metrics.csv`` when it is created (it assumes a
    new run); a replacement rank 0 continues the same file and its header instead.
    """
    try:
        from lightning.pytorch.loggers import CSVLogger
    except ImportError:  # pragma: no cover
        return
    if not isinstance(logger, CSVLogger) or logger._experiment is not None:
        return
    log_dir = logger.log_dir
    if "://" in log_dir:
        return
    path = os.path.join(log_dir, "metrics.csv")
    kept = f"{path}.checkpointless"
    had = os.path.isfile(path)
    if had:
        os.replace(path, kept)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*exists and is not empty.*")
            writer = logger.experiment
    finally:
        if had:
            os.replace(kept, path)
    if had:
        import csv

        with open(path, newline="") as f:
            header = next(csv.reader(f), [])
        writer.metrics_keys = list(header)
