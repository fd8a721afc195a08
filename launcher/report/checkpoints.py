"""The durable tier's ``checkpoint_history.csv``, folded into one row per step.

The history has one row per save attempt *and rank*; the report shows one row per
step (all ranks' bytes, the slowest rank's duration, so the throughput is the job's).
The persistence root may be shared by several runs (``persistence.resume: auto``
resumes into the same root), so only rows written while this run was alive are kept.

Where the history lives: ``--checkpoints URL`` when given (then an unreadable URL is an
error), else ``persistence.path`` from the recipe the agents recorded in their
``agent_start`` event (then a problem is shown in the report, not raised: the events
alone still make a useful report).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

from launcher.report.events import ReportError
from launcher.report.model import Run

_GOOD = ("ok", "exists")
_RANKING = {"ok": 4, "exists": 4, "failed": 3, "aborted": 2, "skipped": 1}
WINDOW_SLACK_S = 2.0


@dataclass
class CheckpointRow:
    step: int
    status: str
    ranks_ok: int
    ranks: int
    nbytes: int
    duration_s: float
    started_at: float
    finished_at: float
    detail: str = ""
    stored: str = "-"  # what the persistence root holds for this step now (manifest check)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def throughput_MBps(self) -> float:
        return self.nbytes / self.duration_s / 1e6 if self.duration_s > 0 else 0.0


@dataclass
class Checkpoints:
    url: str | None
    rows: list[CheckpointRow] = field(default_factory=list)
    note: str = ""  # why there is nothing, or what was left out
    history_rows: int = 0


def locate(run: Run, explicit: str | None) -> tuple[str | None, dict[str, Any], str]:
    """(url, storage options, note) of the run's durable checkpoints."""
    persistence = run.config.get("persistence") or {}
    options: dict[str, Any] = {}  # never recorded (see launcher.report.record)
    if explicit:
        return explicit, options, ""
    path = str(persistence.get("path") or "")
    if not run.config:
        return None, {}, ("the events do not record the run's recipe; pass --checkpoints URL "
                          "to show its durable checkpoints")
    if not path:
        return None, {}, "persistence.path was not set: this run wrote no durable checkpoints"
    if "://" not in path and not os.path.isabs(path) and run.cwd:
        path = os.path.join(run.cwd, path)  # relative to where the agent ran
    return path, options, ""


def load_checkpoints(url: str, options: dict[str, Any], run: Run, *, strict: bool) -> Checkpoints:
    """Read and fold the history under ``url``; ``strict`` turns problems into errors."""
    try:
        from replication.durable.history import read_history

        raw = read_history(url, options)
    except Exception as exc:  # fsspec reports a bad URL in many exception types
        message = f"cannot read the checkpoint history under {url!r}: {type(exc).__name__}: {exc}"
        if strict:
            raise ReportError(message) from None
        return Checkpoints(url, note=message)
    if not raw:
        note = f"no checkpoint_history*.csv under {url!r}"
        if strict and not _exists(url, options):
            raise ReportError(f"--checkpoints {url!r}: not found")
        return Checkpoints(url, note=note)
    lo, hi = run.t0 - WINDOW_SLACK_S, run.t_end + WINDOW_SLACK_S
    parsed = [r for r in (_parse(row) for row in raw) if r is not None]
    mine = [r for r in parsed if lo <= r["ts"] <= hi]
    out = Checkpoints(url, rows=_fold(mine, run.world_size), history_rows=len(mine))
    left = len(raw) - len(mine)
    if left:
        out.note = (f"{left} history row(s) from other runs (or unreadable) under this root "
                    "were left out")
    _mark_stored(out, options)
    return out


def _mark_stored(out: Checkpoints, options: dict[str, Any]) -> None:
    """What each step's directory holds now: a valid manifest, or why not.

    The history says what each rank's writer did; only the manifest (written last)
    says that a checkpoint is complete and loadable. Retention may have pruned it since.
    """
    try:
        from replication.durable import scan

        infos = {i.step: i for i in scan(out.url, options)}
    except Exception as exc:  # storage trouble must not cost the rest of the report
        out.note = " ".join(filter(None, [out.note, f"could not scan {out.url!r}: {exc}"]))
        return
    for row in out.rows:
        info = infos.get(row.step)
        if info is None:
            row.stored = "absent (pruned, or never completed)"
        else:
            row.stored = info.status + (f" ({info.reason})" if info.reason else "")


def _exists(url: str, options: dict[str, Any]) -> bool:
    try:
        from replication.durable.storage import resolve

        fs, root = resolve(url, options)
        return bool(fs.exists(root))
    except Exception:
        return False


def _parse(row: dict[str, str]) -> dict[str, Any] | None:
    try:
        when = datetime.datetime.strptime(row["timestamp"], "%Y-%m-%dT%H:%M:%S.%fZ")
        return {
            "ts": when.replace(tzinfo=datetime.timezone.utc).timestamp(),
            "step": int(row["step"]), "rank": int(row["rank"]),
            "bytes": int(row.get("bytes") or 0), "duration": float(row.get("duration_s") or 0),
            "status": (row.get("status") or "?").strip(), "detail": row.get("detail") or "",
        }
    except (KeyError, ValueError, TypeError):
        return None


def _fold(rows: list[dict[str, Any]], world_size: int) -> list[CheckpointRow]:
    by_step: dict[int, dict[int, dict[str, Any]]] = {}
    for r in rows:  # per (step, rank) the most conclusive attempt
        ranks = by_step.setdefault(r["step"], {})
        old = ranks.get(r["rank"])
        if old is None or _RANKING.get(r["status"], 0) >= _RANKING.get(old["status"], 0):
            ranks[r["rank"]] = r
    out = []
    for step, ranks in sorted(by_step.items()):
        good = [r for r in ranks.values() if r["status"] in _GOOD]
        total = max(world_size, len(ranks))
        if good and len(good) == total:
            status = "ok"
        elif good:
            status = f"partial ({len(good)}/{total} ranks)"
        else:
            statuses = sorted({r["status"] for r in ranks.values()})
            status = "/".join(statuses)
        detail = next((r["detail"] for r in ranks.values() if r["detail"]), "")
        pick = good or list(ranks.values())
        out.append(CheckpointRow(
            step=step, status=status, ranks_ok=len(good), ranks=total,
            nbytes=sum(r["bytes"] for r in good),
            duration_s=max((r["duration"] for r in good), default=0.0),
            started_at=min(r["ts"] - r["duration"] for r in pick),
            finished_at=max(r["ts"] for r in pick), detail=detail,
        ))
    return out
