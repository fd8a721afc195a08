"""Ring liveness (ADR 0023): each agent watches its next ``WATCHERS`` nodes, and losses
are published for everyone else. No processes: N :class:`PeerWatch` instances take turns
on one real TCPStore client, and a counting wrapper measures what each ``check`` reads.
A node is "killed" by no longer bumping its heartbeat (and no longer checking).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import pytest

from launcher import liveness, membership
from launcher.liveness import WATCHERS, PeerWatch
from recovery.generation import protocol
from recovery.job_store import auth
from replication.side_channel import signing
from replication.side_channel.signing import Signer
from tests.helpers.mp import free_port, tcp_store

TIMEOUT_S = 1.0
PERIOD_S = 0.1


class CountingStore:
    """A store client that counts the keys (and round trips) it is asked to read."""

    def __init__(self, store) -> None:
        self._store = store
        self.keys = 0
        self.trips = 0

    def reset(self) -> None:
        self.keys = self.trips = 0

    def _read(self, n: int) -> None:
        self.keys += n
        self.trips += 1

    def get(self, key: str) -> bytes:
        self._read(1)
        return self._store.get(key)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        self._read(len(keys))
        return self._store.multi_get(list(keys))

    def check(self, keys: Sequence[str]) -> bool:
        self._read(len(keys))
        return self._store.check(list(keys))

    def compare_set(self, key: str, expected, desired) -> bytes:
        self._read(1)
        return self._store.compare_set(key, expected, desired)

    def __getattr__(self, name: str):  # writes (set, append) are not reads
        return getattr(self._store, name)


@pytest.fixture(autouse=True)
def job_key():
    """A fresh job key; rejected values are collected instead of printed."""
    found: list[dict] = []
    signing.install(Signer(os.urandom(32)))
    auth.set_reporter(lambda **f: found.append(f))
    auth._reported.clear()
    yield found
    auth.set_reporter(None)
    auth._reported.clear()
    signing.install(None)


class Ring:
    """``n`` registered nodes, each with its own watch; the test plays every agent."""

    def __init__(self, n: int, gen: int = 0) -> None:
        port = free_port()
        self.master = tcp_store(port, is_master=True, timeout_s=30)
        self.store = CountingStore(tcp_store(port, is_master=False, timeout_s=30))
        for node in range(n):
            membership.register(self.master, node, nproc=1, spare=False)
        self.landed()
        self.watches = {node: PeerWatch(node, TIMEOUT_S) for node in range(n)}
        self.alive = set(range(n))
        self.seq = 0
        self.gen = gen
        #: node -> {lost node: monotonic time this agent first reported it}
        self.seen: dict[int, dict[int, float]] = {node: {} for node in range(n)}
        #: When the newest beats were written, and the longest one pass has taken (beats
        #: and checks of every live agent): a loaded host makes passes slow.
        self.beat_at = 0.0
        self.longest_period_s = 0.0

    def landed(self) -> None:
        """c10d's SET gets no reply: a round trip on the same socket makes the master's
        writes land before the watches' client reads."""
        self.master.check([protocol.LIVENESS_VERSION_KEY])

    def kill(self, *nodes: int) -> float:
        self.alive -= set(nodes)
        return time.monotonic()

    def period(self) -> list[int]:
        """One heartbeat interval: every live agent beats, then checks; returns the
        per-check key counts."""
        self.seq += 1
        start = self.beat_at = time.monotonic()
        for node in sorted(self.alive):
            auth.put(self.master, protocol.agent_heartbeat_key(node), str(self.seq))
        counts = []
        for node in sorted(self.alive):
            self.store.reset()
            now = time.monotonic()
            for lost in self.watches[node].check(self.store, self.gen):
                self.seen[node].setdefault(lost, now)
            counts.append(self.store.keys)
        self.longest_period_s = max(self.longest_period_s, time.monotonic() - start)
        return counts

    def run_until(self, done, limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        while not done():
            assert time.monotonic() < deadline, "timed out"
            start = time.monotonic()
            self.period()
            time.sleep(max(0.0, PERIOD_S - (time.monotonic() - start)))

    def everyone_knows(self, *nodes: int) -> bool:
        return all(set(nodes) <= self.watches[a].lost for a in self.alive)

    def watchers_of(self, node: int) -> set[int]:
        return {a for a in self.alive if node in self.watches[a].watched}


def steady_cost(n: int) -> tuple[int, int]:
    """(max keys, max round trips) one agent reads per check once the ring is read."""
    ring = Ring(n)
    ring.period()  # the first check reads the agents list and the published losses
    keys, trips = 0, 0
    for _ in range(5):
        ring.seq += 1
        for node in sorted(ring.alive):
            auth.put(ring.master, protocol.agent_heartbeat_key(node), str(ring.seq))
        for node in sorted(ring.alive):
            ring.store.reset()
            assert ring.watches[node].check(ring.store, 0) == []
            keys, trips = max(keys, ring.store.keys), max(trips, ring.store.trips)
    return keys, trips


def test_per_agent_cost_per_check_does_not_grow_with_nodes():
    small, large = steady_cost(8), steady_cost(64)
    print(f"\nkeys, round trips per agent per check: 8 nodes {small}, 64 nodes {large}")
    assert small == large == (1 + WATCHERS, 2)


def test_each_node_has_exactly_its_ring_predecessors_as_watchers():
    ring = Ring(8)
    ring.period()
    for node in range(8):
        assert ring.watches[node].watched == [(node + 1) % 8, (node + 2) % 8]
        assert ring.watchers_of(node) == {(node - 1) % 8, (node - 2) % 8}


def test_one_lost_node_is_detected_by_its_watchers_and_learned_by_the_rest():
    ring = Ring(64, gen=3)
    ring.period()
    watchers = ring.watchers_of(10)
    assert watchers == {8, 9}
    assert 10 not in ring.watches[40].watched  # 40 must learn it from a published record
    last_beat = ring.beat_at
    killed = ring.kill(10)
    ring.run_until(lambda: ring.everyone_knows(10), limit_s=TIMEOUT_S + 5)
    detectors = {a for a in ring.alive if ring.watches[a].detected_by(10) == a}
    assert detectors and detectors <= watchers, detectors
    assert {ring.watches[a].detected_by(10) for a in ring.alive} <= watchers
    first = min(ring.seen[a][10] for a in detectors) - killed
    everyone = max(ring.seen[a][10] for a in ring.alive) - killed
    print(f"\nnode 10 lost: detected by {sorted(detectors)} {first:.2f}s after its last "
          f"beat; every other agent knew {everyone:.2f}s after it")
    # A watcher sees the last beat at its check, after the beat was written and before
    # the kill; the detection comes at the first check after a timeout of silence since
    # then. Measured from the beat's writing, not from the kill (on a loaded host a pass
    # over 64 agents can take longer than a period, so the beat may be older than one
    # period at the kill), and bounded by the passes this run took.
    since_beat = first + killed - last_beat
    late = 2 * max(ring.longest_period_s, PERIOD_S) + PERIOD_S
    assert TIMEOUT_S <= since_beat < TIMEOUT_S + late, (since_beat, ring.longest_period_s)
    assert all(set(ring.watches[a].lost) == {10} for a in ring.alive)
    learner = ring.watches[40]
    assert learner.gen_alive(10, -1) == 3 and learner.silent_for(10) >= TIMEOUT_S
    # the watch moved on past the lost node
    assert ring.watches[9].watched == [11, 12] and ring.watches[8].watched == [9, 11]


def test_consecutive_lost_nodes_are_all_detected_by_the_takeover_of_the_watch():
    ring = Ring(64)
    ring.period()
    # 22's watchers (20, 21) are lost with it: only the watch moving on finds it
    assert ring.watchers_of(22) == {20, 21}
    killed = ring.kill(20, 21, 22)
    ring.run_until(lambda: ring.everyone_knows(20, 21, 22), limit_s=3 * TIMEOUT_S + 5)
    assert all(ring.watches[a].lost == {20, 21, 22} for a in ring.alive)
    by = {n: {ring.watches[a].detected_by(n) for a in ring.alive} for n in (20, 21, 22)}
    assert by[20] <= {18, 19} and by[21] == {19} and by[22] <= {18, 19}, by
    last = max(min(ring.seen[a][n] for a in ring.alive) for n in (20, 21, 22))
    print(f"\n20, 21, 22 lost together: all detected {last - killed:.2f}s after their last "
          f"beat (detectors {by})")
    # 22 was entered into a watch when 20 and 21 were detected: one more timeout.
    assert last - killed < 2 * TIMEOUT_S + 6 * PERIOD_S
    assert ring.watches[19].watched == [23, 24] and ring.watches[18].watched == [19, 23]


def test_forged_or_stale_published_losses_lose_nobody(job_key):
    ring = Ring(8)
    for _ in range(3):
        ring.period()
    forged = Signer(os.urandom(32)).seal(protocol.LOST_KEY, "5:1:0:5000:4")
    ring.master.append(protocol.LOST_KEY, b"," + forged + b",")
    # A genuine record, but node 6 has beaten since the sequence it names (a record
    # written back from an earlier loss, or a watcher whose reads lagged).
    protocol.publish_losses(ring.master, [protocol.LostRecord(6, 1, 0, 5.0, 4)])
    ring.landed()
    for _ in range(3):
        ring.period()
    assert all(not ring.watches[a].lost for a in ring.alive)
    assert protocol.LOST_KEY in {f["key"] for f in job_key}  # the forged one was reported


def test_a_published_loss_of_a_node_that_beats_again_is_taken_back_by_its_learner():
    ring = Ring(8)
    ring.period()
    ring.kill(3)  # it stalls: no beats, no checks
    ring.run_until(lambda: ring.everyone_knows(3), limit_s=TIMEOUT_S + 5)
    learner = ring.watches[6]
    assert learner.detected_by(3) != 6 and not learner.returned(ring.store, 3, 0)
    ring.alive.add(3)  # it wakes up and beats again
    ring.period()
    assert learner.returned(ring.store, 3, 0)
    assert 3 not in learner.lost
    # the returned node is watched again by its predecessors once they see it back
    assert ring.watches[1].returned(ring.store, 3, 0)
    assert ring.watches[1].watched == [2, 3]


def test_a_node_registering_later_enters_the_ring():
    ring = Ring(4)
    ring.period()
    assert ring.watches[3].watched == [0, 1]
    membership.register(ring.master, 4, nproc=1, spare=True)
    ring.landed()
    ring.watches[4] = PeerWatch(4, TIMEOUT_S)
    ring.alive.add(4)
    ring.seen[4] = {}
    ring.period()
    assert ring.watches[3].watched == [4, 0] and ring.watches[2].watched == [3, 4]
    assert ring.watches[4].watched == [0, 1]


def test_a_replayed_version_delays_a_reread_by_at_most_refresh_every_checks():
    """A forger writes the old liveness version back to hide a registration: the
    watchers still re-read the agents list within ``REFRESH_EVERY`` checks."""
    ring = Ring(4)
    ring.period()
    old = bytes(ring.master.get(protocol.LIVENESS_VERSION_KEY))
    membership.register(ring.master, 4, nproc=1, spare=True)
    ring.master.set(protocol.LIVENESS_VERSION_KEY, old)
    ring.landed()
    ring.watches[4] = PeerWatch(4, TIMEOUT_S)
    ring.seen[4] = {}
    ring.alive.add(4)
    checks = 0  # since node 3's last re-read (its first check)
    while ring.watches[3].watched != [4, 0]:
        assert ring.watches[3].watched == [0, 1]
        ring.period()
        checks += 1
        assert checks <= liveness.REFRESH_EVERY, "the new node never entered the ring"
    assert checks == liveness.REFRESH_EVERY  # not before: the replay did hide it until then
