"""The agent's store lease (``launcher.liveness.StoreLease``): a node whose heartbeat
cannot reach the job store for a heartbeat timeout stops its workers (ADR 0021), but a
beat that was merely late (the agent was not scheduled) or stuck on a store host that
still accepts connections (not scheduled either) costs nothing."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from launcher.liveness import StoreLease


def _lease(blocked_since: float | None, timeout_s: float = 0.5, reachable: bool = False):
    beat = SimpleNamespace(blocked_since=blocked_since)
    fired: list[float] = []
    done = threading.Event()

    def on_lost(stuck_s: float) -> None:
        fired.append(stuck_s)
        done.set()

    lease = StoreLease(beat, timeout_s, on_lost, reachable=lambda: reachable,  # type: ignore[arg-type]
                       interval_s=0.02)
    return lease, beat, fired, done


def test_a_beat_stuck_for_the_timeout_fences_once_per_stuck_beat():
    lease, beat, fired, done = _lease(time.monotonic())
    lease.start()
    try:
        assert done.wait(5.0), "the lease never fired on a beat stuck past the timeout"
        time.sleep(0.3)
        assert len(fired) == 1 and fired[0] >= 0.5, fired
        done.clear()
        beat.blocked_since = None  # the link is back: the beat went through
        time.sleep(0.1)
        beat.blocked_since = time.monotonic()  # and the next one is stuck again
        assert done.wait(5.0), "the lease did not watch again after the node came back"
        assert len(fired) == 2, fired
    finally:
        lease.stop()
        lease.join(2.0)


def test_beats_that_get_through_keep_the_lease():
    lease, beat, fired, _done = _lease(None)
    lease.start()
    try:
        for _ in range(40):  # 0.8 s of beats, each written within 10 ms
            beat.blocked_since = time.monotonic()
            time.sleep(0.01)
            beat.blocked_since = None
            time.sleep(0.01)
    finally:
        lease.stop()
        lease.join(2.0)
    assert not fired, fired


def test_time_the_lease_was_not_scheduled_does_not_count():
    """A beat that started long ago (the whole agent was stopped) gets a full timeout
    from the moment the lease looks again, time enough to go through."""
    lease, beat, fired, _done = _lease(time.monotonic() - 10.0)
    lease._interval = 0.4  # its first look comes after more than half a timeout
    lease.start()
    time.sleep(0.45)
    beat.blocked_since = None  # the beat went through right after the wake-up
    time.sleep(0.6)
    lease.stop()
    lease.join(2.0)
    assert not fired, fired


def test_a_store_host_that_still_accepts_is_slow_not_gone():
    """A beat stuck because the store host is not scheduled (its kernel still completes
    TCP handshakes) keeps the lease: the whole job would otherwise stop its workers."""
    lease, _beat, fired, _done = _lease(time.monotonic(), reachable=True)
    lease.start()
    time.sleep(1.0)
    lease.stop()
    lease.join(2.0)
    assert not fired, fired
