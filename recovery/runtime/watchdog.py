"""The worker's watchdog: heartbeats to the agent, failure events from the store.

A daemon thread touches the heartbeat file the agent watches (a SIGSTOPped process
stops touching it, which is how hangs are caught). The job's generation reaches this
rank even while its main thread computes and is not inside a collective that would
fail: the moment a newer generation shows, ``on_failure`` runs (the runtime fails every
collective in flight, :meth:`recovery.process_group.controller.Controller.fail`), so a
survivor blocked in anybody's collective is released at once, not at the collective
timeout.

How the generation is watched depends on the connection. With one of its own (a
launched worker), a second daemon thread *blocks* in the store on the next
generation's cause record (``store.wait``, answered by the server the moment a
declarer writes it): no request at all while nothing fails. The first version polled
every 50 ms, 20 requests a second per rank, which at 16k ranks is more than one c10d
store serves (``docs/scale.md``). A wait that never times out is used because
a c10d wait that times out logs two warnings each time. Sharing the caller's
connection (a script run without the launcher), it polls, as a blocking wait would hold
that connection.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from recovery.generation.protocol import cause_key, current_generation
from recovery.runtime.drain import requested as drain_requested

#: A wait that does not end on its own: c10d reads a zero timeout as "now", and a
#: timeout longer than about 24 days overflows its millisecond counter.
NO_TIMEOUT = datetime.timedelta(days=20)


class Watchdog:
    def __init__(
        self,
        store: dist.Store,
        heartbeat_file: str | None,
        heartbeat_interval_s: float,
        poll_s: float = 0.05,
        on_failure: Callable[[int], None] | None = None,
        blocking: bool = False,
    ) -> None:
        """``blocking``: ``store`` is this watchdog's own connection, so it may block in
        it (see the module docstring)."""
        self.store = store
        self.heartbeat_file = heartbeat_file
        self.heartbeat_interval_s = heartbeat_interval_s
        self.poll_s = poll_s
        self.generation = 0  # the generation this rank is running in
        self._seen = 0  # the newest generation observed in the store
        self._reported = 0  # the newest generation ``on_failure`` was called for
        self.on_failure = on_failure
        #: The agent asked this worker to stop for the scheduler (``recovery.runtime.drain``):
        #: looked for at each heartbeat, off the training thread, never in the step.
        self.stop_requested = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="checkpointless-watchdog",
                                        daemon=True)
        self.blocking = blocking
        self._lock = threading.Lock()
        #: Called after each heartbeat, on this thread (the rank's progress report).
        self.on_beat: Callable[[], None] | None = None

    def start(self, generation: int) -> None:
        self.generation = self._seen = generation
        self.beat()
        self._thread.start()
        if self.blocking:
            threading.Thread(target=self._watch, name="checkpointless-generations",
                             daemon=True).start()

    @property
    def seen(self) -> int:
        """The newest generation observed in the store."""
        return self._seen

    def beat(self) -> None:
        if self.heartbeat_file:
            try:
                os.utime(self.heartbeat_file)
            except FileNotFoundError:
                open(self.heartbeat_file, "a").close()

    @property
    def failure_pending(self) -> bool:
        """True once the store shows a generation newer than the one this rank runs."""
        return self._seen > self.generation

    def _loop(self) -> None:
        last_beat = time.monotonic()
        while not self._stop.wait(self.poll_s):
            now = time.monotonic()
            if now - last_beat >= self.heartbeat_interval_s:
                self.beat()
                last_beat = now
                if self.on_beat is not None:
                    self.on_beat()
                self.stop_requested = self.stop_requested or drain_requested(self.heartbeat_file)
            if not self.blocking:
                self._read_generation()
            self._report()

    def _read_generation(self) -> None:
        try:
            self._seen = max(self._seen, current_generation(self.store))
        except Exception:
            pass  # the store host may be restarting; the agent decides about that

    def _watch(self) -> None:
        """Block on the next generation's cause record; read the chain when it appears.
        A record that does not verify (forged) does not advance the chain: then poll
        until a legitimate declarer replaces it."""
        while not self._stop.is_set():
            try:
                self.store.wait([cause_key(self._seen + 1)], NO_TIMEOUT)
            except Exception:
                time.sleep(self.poll_s)  # the store host may be restarting
                continue
            before = self._seen
            self._read_generation()
            self._report()
            if self._seen == before:
                time.sleep(self.poll_s)

    def _report(self) -> None:
        with self._lock:
            seen = self._seen
            if not (seen > self.generation and seen > self._reported and self.on_failure):
                return
            self._reported = seen
        try:
            self.on_failure(seen)
        except Exception:
            pass  # never let the abort path kill the heartbeat

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)
