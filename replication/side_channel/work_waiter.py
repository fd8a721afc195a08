"""Waits on gloo works that an abort can end for the waiter, whatever gloo does.

Shutting down an aborted group's sockets (:mod:`.abortable_gloo`) fails most pending
operations at once, but not all: now and then a point-to-point send or receive, or an
all-gather, stays pending until its own timeout (``replication.timeout_s``, 120 s by
default) although its pair's socket was shut down or closed by the dead peer. Seen in
``tests/test_side_channel_teardown.py``: about one abort in 20, mid-round, with the
peer SIGKILLed, SIGSTOPped or alive; the chaos soak's 120 s stalls had a replication
round's thread blocked there. gloo's works offer no abort from Python (torch 2.13),
and a wait in short slices is no way out either: a timed-out send or receive closes
every pair of the group.

So a caller never blocks inside gloo: each calling thread gets a waiter thread that
does the blocking wait, and the caller waits for a :class:`Pending` that either the
waiter or :meth:`Waiters.abandon` completes. After an abort the caller is released at
once; a wait gloo never ends is left to its waiter thread (a daemon) until gloo's own
timeout, and holds nothing but the aborted group.
"""

from __future__ import annotations

import datetime
import queue
import threading
import weakref

from replication.errors import CheckpointlessError

_abandoned: weakref.WeakSet[_Waiter] = weakref.WeakSet()


def abandoned_waits() -> int:
    """Waiter threads still inside a wait on an aborted channel (gloo ends it at the
    channel's timeout). The interpreter's exit would wait for them; see
    ``recovery.process_group.training_groups.holding``."""
    return sum(1 for w in list(_abandoned) if w.busy)


class Abandoned(CheckpointlessError):
    """The channel was aborted while this work was waited for."""


class Pending:
    """One work being waited for: ``ended`` is set once it ended or was abandoned."""

    __slots__ = ("ended", "error", "work")

    def __init__(self, work: object) -> None:
        self.work = work
        self.ended = threading.Event()
        self.error: BaseException | None = None


class _Waiter:
    """A daemon thread waiting on one calling thread's works, in the order handed in."""

    def __init__(self, name: str, timeout: datetime.timedelta) -> None:
        self._queue: queue.SimpleQueue[Pending | None] = queue.SimpleQueue()
        self._timeout = timeout
        self.busy = False
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def submit(self, pending: Pending) -> None:
        self._queue.put(pending)

    def stop(self) -> None:
        self._queue.put(None)

    def _loop(self) -> None:
        while (pending := self._queue.get()) is not None:
            self.busy = True
            try:
                pending.work.wait(self._timeout)  # type: ignore[attr-defined]
            except Exception as exc:  # gloo raises RuntimeError subclasses
                if pending.error is None:
                    pending.error = exc
            finally:
                self.busy = False
            pending.ended.set()
            del pending


class Waiters:
    """The waiter threads of one channel (one per calling thread), and the works they
    wait for; :meth:`abandon` releases every caller at once."""

    def __init__(self, name: str, timeout: datetime.timedelta) -> None:
        self._name, self._timeout = name, timeout
        self._lock = threading.Lock()
        self._by_thread: dict[int, _Waiter] = {}
        self._waiting: set[Pending] = set()
        self._abandoned = False

    def wait(self, work: object) -> None:
        """Block until ``work`` ended; raise its error, or :class:`Abandoned`."""
        pending = Pending(work)
        with self._lock:
            if self._abandoned:
                raise Abandoned()
            caller = threading.get_ident()
            waiter = self._by_thread.get(caller)
            if waiter is None:
                waiter = self._by_thread[caller] = _Waiter(
                    f"{self._name}-{len(self._by_thread)}", self._timeout)
            self._waiting.add(pending)
        waiter.submit(pending)
        pending.ended.wait()
        with self._lock:
            self._waiting.discard(pending)
        if pending.error is not None:
            raise pending.error

    def abandon(self) -> None:
        """Release every caller now (:class:`Abandoned`), and later ones at once; the
        waiter threads end once the wait each is in ends."""
        with self._lock:
            self._abandoned = True
            waiting, self._waiting = list(self._waiting), set()
            waiters, self._by_thread = list(self._by_thread.values()), {}
        for pending in waiting:
            if pending.error is None:
                pending.error = Abandoned()
            pending.ended.set()
        for waiter in waiters:
            _abandoned.add(waiter)
            waiter.stop()

    def close(self) -> None:
        """Let the waiter threads end (nothing is waited for after this)."""
        with self._lock:
            waiters, self._by_thread = list(self._by_thread.values()), {}
        for waiter in waiters:
            waiter.stop()
