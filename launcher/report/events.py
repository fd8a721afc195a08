"""Read a run's ``events.jsonl`` strictly enough to trust it, loosely enough to survive.

Agents and workers append one JSON object per line (``recovery.generation.protocol.EventLog``).
A process killed mid-write can leave a torn *last* line, which is expected and skipped.
Anything else that does not parse, or an object without ``event`` and a numeric ``ts``,
means the file is not what the report thinks it is, so it is refused with the line
number at fault instead of producing a report that quietly leaves events out.

This module deliberately does not import :mod:`recovery.generation.protocol` (which imports
torch): reading a run must stay as fast as ``checkpointless --help``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from recovery.common.events import Event
from replication.errors import CheckpointlessError

EVENTS_FILE = "events.jsonl"


class ReportError(CheckpointlessError):
    """Bad input to the report (missing run dir, unusable events or history)."""


@dataclass
class EventsFile:
    path: str
    events: list[dict[str, Any]] = field(default_factory=list)
    torn_last_line: bool = False

    @property
    def sources(self) -> list[str]:
        return sorted({str(e.get("source", "?")) for e in self.events})


def events_path(run_dir: str) -> str:
    """``RUN_DIR/events.jsonl``, after checking that ``run_dir`` is a directory."""
    if not os.path.exists(run_dir):
        raise ReportError(f"run directory {run_dir!r} does not exist")
    if not os.path.isdir(run_dir):
        raise ReportError(f"run directory {run_dir!r} is not a directory")
    path = os.path.join(run_dir, EVENTS_FILE)
    if not os.path.isfile(path):
        raise ReportError(f"{path}: no events file (is {run_dir!r} the --run-dir of a "
                          "'checkpointless run'?)")
    return path


def load_events(path: str) -> EventsFile:
    """Every event of the file, in file order; see the module docstring for the rules."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ReportError(f"{path}: cannot read ({exc.strerror or exc})") from None
    text = raw.decode("utf-8", errors="replace")
    lines = text.split("\n")
    # A file ending in "\n" splits into a trailing "": that is not a line.
    if lines and lines[-1] == "":
        lines.pop()
    out = EventsFile(path)
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        last = number == len(lines)
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if last:
                out.torn_last_line = True
                break
            raise ReportError(f"{path} line {number}: not a JSON event ({exc.msg}): "
                              f"{_clip(line)}") from None
        problem = _check(record)
        if problem:
            if last and not text.endswith("\n"):
                out.torn_last_line = True
                break
            raise ReportError(f"{path} line {number}: {problem}: {_clip(line)}")
        out.events.append(record)
    if not out.events:
        raise ReportError(f"{path}: no events in the file" + (
            " (only a torn line)" if out.torn_last_line else " (it is empty)"))
    out.events.sort(key=lambda e: float(e["ts"]))  # writers race; time order is what we show
    return out


#: Fields the report relies on, per event, with their JSON types (others are optional).
REQUIRED: dict[str, dict[str, type | tuple[type, ...]]] = {
    Event.STEP: {"step": int},
    Event.FAILURE_DECLARED: {"gen": int, "cause": dict},
    Event.RECOVERY: {"gen": int, "rank": int, "target_step": int, "timings": dict},
    Event.RESUMED: {"gen": int},
    Event.DURABLE_FALLBACK: {"gen": int},
    Event.WORKER_EXIT: {"rank": int},
    Event.REPLACEMENT_ASSIGNED: {"rank": int},
    Event.AGENT_START: {"node": int},
}


def _check(record: Any) -> str | None:
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    name = record.get("event")
    if not isinstance(name, str):
        return "the event has no 'event' name"
    ts = record.get("ts")
    if not _is(ts, (int, float)):
        return f"the event has no numeric 'ts' (got {ts!r})"
    for key, kind in REQUIRED.get(name, {}).items():
        if not _is(record.get(key), kind):
            want = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            return f"a {name!r} event needs {key!r} as {want} (got {record.get(key)!r})"
    cause = record.get("cause")
    if isinstance(cause, dict) and "ts" in cause and not _is(cause["ts"], (int, float)):
        return f"the cause of a {name!r} event has a non-numeric 'ts' ({cause['ts']!r})"
    return None


def _is(value: Any, kind: type | tuple[type, ...]) -> bool:
    """isinstance, except that a JSON true/false is not a number."""
    return isinstance(value, kind) and not isinstance(value, bool)


def _clip(line: str, limit: int = 80) -> str:
    return repr(line if len(line) <= limit else line[:limit] + "...")
