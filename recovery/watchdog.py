"""The worker's watchdog thread: heartbeats to the agent, failure events from the store.

One daemon thread does both. It touches the heartbeat file the agent watches (a
SIGSTOPped process stops touching it, which is how hangs are caught), and it polls the
job's generation counter, so a failure declared anywhere reaches this rank even while
its main thread computes and is not inside a collective that would fail. The moment it
sees a newer generation it calls ``on_failure`` (the runtime fails every collective in
flight there, :meth:`recovery.elastic_controller.Controller.fail`), so a survivor blocked in
anybody's collective is released within one poll, not at the collective timeout.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from recovery.protocol import current_generation


class Watchdog:
    def __init__(
        self,
        store: dist.Store,
        heartbeat_file: str | None,
        heartbeat_interval_s: float,
        poll_s: float = 0.05,
        on_failure: Callable[[int], None] | None = None,
    ) -> None:
        self.store = store
        self.heartbeat_file = heartbeat_file
        self.heartbeat_interval_s = heartbeat_interval_s
        self.poll_s = poll_s
        self.generation = 0  # the generation this rank is running in
        self._seen = 0  # the newest generation observed in the store
        self._reported = 0  # the newest generation ``on_failure`` was called for
        self.on_failure = on_failure
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="checkpointless-watchdog",
                                        daemon=True)

    def start(self, generation: int) -> None:
        self.generation = self._seen = generation
        self.beat()
        self._thread.start()

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
            try:
                self._seen = max(self._seen, current_generation(self.store))
            except Exception:
                pass  # the store host may be restarting; the agent decides about that
            seen = self._seen
            if seen > self.generation and seen > self._reported and self.on_failure:
                self._reported = seen
                try:
                    self.on_failure(seen)
                except Exception:
                    pass  # never let the abort path kill the heartbeat

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)
