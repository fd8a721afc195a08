"""The caller's handle on one save, and the save as the durable writer queues it.

:class:`PersistTicket` is the whole contract between :meth:`DurableWriter.submit
<replication.durable.writer.DurableWriter.submit>` and its caller: ``released`` (the
writer no longer needs the caller's buffer: the snapshot slot may be reused) and
``done`` (the save's :class:`~replication.durable.saver.SaveResult`). The caller (the
runtime, the Lightning checkpoint IO) waits on it; the writer's thread completes it.
:class:`Job` is what the writer keeps of a submitted save until then.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from replication.durable.saver import SaveResult
from replication.training_state.snapshot_meta import SnapshotMeta


class PersistTicket:
    """The caller's side of one :meth:`DurableWriter.submit`."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.released: Future[None] = Future()
        self.done: Future[SaveResult] = Future()
        # time.monotonic() when the writer took it on (after the helper's start-up, for a
        # first save) and when it finished: how long the writer was busy with it.
        self.submitted_at = time.monotonic()
        self.finished_at: float | None = None

    def wait_released(self, timeout: float | None = None) -> bool:
        """Block until the writer is done with the submitted buffer; False on timeout."""
        try:
            self.released.result(timeout)
            return True
        except TimeoutError:
            return False

    def result(self, timeout: float | None = None) -> SaveResult:
        return self.done.result(timeout)

    def _release(self) -> None:
        if not self.released.done():
            self.released.set_result(None)

    @property
    def busy_s(self) -> float | None:
        """Seconds from the writer taking it on to its result (None: not done yet)."""
        return None if self.finished_at is None else self.finished_at - self.submitted_at

    def _finish(self, result: SaveResult) -> None:
        self._release()
        if not self.done.done():
            self.finished_at = time.monotonic()
            self.done.set_result(result)


@dataclass
class Job:
    """A submitted save, from :meth:`DurableWriter.submit` to its result."""

    meta: SnapshotMeta
    buffer: torch.Tensor
    ticket: PersistTicket
    release_by: float | None = None  # time.monotonic() deadline for ``released``
    direct: bool = False  # read ``buffer`` in place (zero-copy or staging=False)
    abort: threading.Event = dataclasses.field(default_factory=threading.Event)
