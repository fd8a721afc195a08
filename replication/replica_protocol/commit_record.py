"""Rank 0's store record of the committed step, written off the training path.

The tree commit (:mod:`.commit_tree`) agrees on a step over the side channel; the only
store operation left on a step's path was rank 0's sealed write of the committed step.
With etcd as the store, that write blocks while etcd has no quorum, so training stalled
for as long as the quorum was lost, although nothing in training needed the store.
The record is now a hint for readers outside the agreement (the durable tier's "steps
lost", the fault injector's log, ``checkpointless report``) and a candidate for the
recovery target: the planner takes the newest step that any join record says is
committed (``recovery.generation.rendezvous.choose_plan``), so a lagging record never makes a
recovery target a step some rank has already dropped (ADR 0022, addendum 2).

:class:`CommittedRecorder` keeps the newest step to record and writes it from a thread
of its own: latest wins, a write that fails (the store has no quorum) is retried with
a backoff, and the training thread never waits. Steps only ever grow.
"""

from __future__ import annotations

import logging
import threading
import time

import torch.distributed as dist

from replication.side_channel import signing

log = logging.getLogger("checkpointless.replication")

#: Seconds between retries of a write that failed (doubling up to the maximum).
RETRY_S, RETRY_MAX_S = 0.2, 5.0


class CommittedRecorder:
    """Writes the newest committed step, sealed, to ``store[key]`` in the background."""

    def __init__(self, store: dist.Store, key: str) -> None:
        self.store, self.key = store, key
        self._cond = threading.Condition()
        self._wanted = -1  # the newest step handed in
        self._written = -1  # the newest step known to be in the store
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="checkpointless-commit-record",
                                        daemon=True)
        self._thread.start()

    def record(self, step: int) -> None:
        """Hand in ``step`` (called on the commit path: returns at once)."""
        with self._cond:
            if step > self._wanted:
                self._wanted = step
                self._cond.notify()

    @property
    def written(self) -> int:
        """The newest step whose write the store has confirmed."""
        with self._cond:
            return self._written

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the newest step handed in to be written."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._written < self._wanted and not self._stopped:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return self._written >= self._wanted

    def stop(self) -> None:
        """Stop writing: a step not written yet is dropped (a rollback follows, and a
        record of the old timeline must not land after it). A write already under way
        may still land; the planner does not trust a record newer than every rank's
        knowledge (``recovery.generation.rendezvous.choose_plan``)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def _run(self) -> None:
        delay, failing_since = RETRY_S, None
        while True:
            with self._cond:
                while not self._stopped and self._wanted <= self._written:
                    self._cond.wait()
                if self._stopped:
                    return
                step = self._wanted
            try:
                self.store.set(self.key, signing.seal(self.key, str(step)))
                # A c10d ``set`` gets no reply of its own: the ``check`` is a round trip
                # on the same connection, so the record has landed when it returns.
                self.store.check([self.key])
            except Exception as exc:  # the store is away (no quorum, a failover): retry
                if failing_since is None:
                    failing_since = time.monotonic()
                    log.warning("the committed-step record (step %d) could not be written "
                                "to the job store: %s; retrying in the background", step,
                                " ".join(str(exc).split())[:200])
                with self._cond:
                    self._cond.wait(delay)
                delay = min(RETRY_MAX_S, delay * 2)
                continue
            if failing_since is not None:
                log.warning("the committed-step record reached the job store again after "
                            "%.1fs (step %d)", time.monotonic() - failing_since, step)
            delay, failing_since = RETRY_S, None
            with self._cond:
                self._written = max(self._written, step)
                self._cond.notify_all()
