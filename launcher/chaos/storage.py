"""Storage that starts failing: a checkpoint path whose target can be swapped out.

The job writes its checkpoints to ``<dir>/durable`` (or ``<dir>/dcp``), a symbolic link
to a real directory. An outage atomically re-points the link at a regular file, so
every write under the path fails with ``ENOTDIR`` (a store that vanished), exactly as
the processes see it, whatever user they run as (``chmod`` would not stop root); the
end of the outage points it back. The checkpoints written before the outage stay
untouched in the real directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from launcher.chaos.schedule import Fault
from recovery.common.events import Event


class StorageSwitch:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.real = path.with_name(path.name + ".real")
        self.blocked = path.with_name(path.name + ".unavailable")
        self.real.mkdir(parents=True, exist_ok=True)
        self.blocked.write_text("storage outage injected by the chaos benchmark\n")
        self._point(self.real)

    def _point(self, target: Path) -> None:
        tmp = self.path.with_name(self.path.name + ".swap")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        os.symlink(target, tmp)
        os.replace(tmp, self.path)

    @property
    def down(self) -> bool:
        return os.readlink(self.path) == str(self.blocked)

    def fail(self) -> None:
        self._point(self.blocked)

    def restore(self) -> None:
        self._point(self.real)


class OutagePlayer:
    """Plays the schedule's storage outages: each starts when rank 0 completes its step
    and ends ``duration_s`` later. Applied outages are logged to the run's timeline."""

    def __init__(self, switch: StorageSwitch, outages: Sequence[Fault], timeline: Path,
                 log: Callable[[str], None] = lambda _m: None) -> None:
        self.switch = switch
        self.todo = sorted(outages, key=lambda f: f.step)
        self.timeline, self.log = timeline, log
        self.active: tuple[Fault, float, int] | None = None  # fault, end (monotonic), step
        self.applied: list[dict[str, Any]] = []
        self.step = 0

    def on_step(self, step: int) -> None:
        self.step = step
        if self.active is None and self.todo and step >= self.todo[0].step:
            fault = self.todo.pop(0)
            self.switch.fail()
            self.active = (fault, time.monotonic() + fault.duration_s, step)
            self._emit(Event.STORAGE_OUTAGE_START, incident=fault.incident, step=step,
                       duration_s=fault.duration_s)
            self.log(f"storage outage for {fault.duration_s}s from step {step}")

    def tick(self) -> None:
        if self.active is not None and time.monotonic() >= self.active[1]:
            self._end()

    def close(self) -> None:
        if self.active is not None:
            self._end()

    def _end(self) -> None:
        assert self.active is not None
        fault, _, first = self.active
        self.switch.restore()
        self.active = None
        self.applied.append({"incident": fault.incident, "from_step": first,
                             "to_step": self.step, "duration_s": fault.duration_s})
        self._emit(Event.STORAGE_OUTAGE_END, incident=fault.incident, step=self.step)

    def _emit(self, event: str, **fields: Any) -> None:
        record = {"ts": time.time(), "event": event, "source": "chaos", "rank": -1, **fields}
        fd = os.open(self.timeline, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
        finally:
            os.close(fd)
