"""Which agents are alive: this agent's heartbeat, its watch over the others, and the
watch for every rank having finished.

``agent_heartbeat_key(n)`` is a counter that agent ``n``'s heartbeat thread bumps.
With an etcd job store the thread also holds an etcd lease whose time-to-live is the
heartbeat timeout and keeps a sealed "alive" record bound to it
(``agent_lease_key(n)``): etcd deletes the record when the agent stops renewing, on the
cluster's clock, and a watcher then needs only one quick confirmation that the counter
stopped too (:class:`PeerWatch`), instead of a whole timeout of silence of its own.
Observers judge liveness by *change* of the value, timed on their own monotonic clock,
so no two machines' clocks are ever compared. Heartbeats are sealed sequence numbers
(:mod:`recovery.auth`), so a forger can neither fake a beat for a dead node nor make a
live one look silent by writing an old value back. The heartbeat thread also puts back
this agent's owner record (:func:`launcher.membership.reassert_owner`) and the
generation records if something overwrote them (``docs/security.md`` says what remains
possible).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist

from launcher.job_store import OP_TIMEOUT_S, StoreUnavailable, connect_store
from launcher.membership import reassert_owner, registered_nodes
from recovery import auth, protocol, store_address
from recovery.store_address import StoreAddress
from replication import signing

#: A beat later than this many intervals (plus a second) is reported on the console.
HEARTBEAT_LATE_FACTOR = 2.0


class Heartbeat(threading.Thread):
    """Writes this agent's sealed heartbeat sequence number on its own connection.

    A separate client keeps beats flowing while the main loop waits on the store (a
    ``declare_failure`` can take a while), and avoids sharing one socket between threads.
    Each beat also puts back this agent's owner record and the generation records if a
    forger replaced them (:func:`reassert_owner`, ``protocol.reassert_generations``).
    """

    def __init__(self, address: StoreAddress, node: int, interval_s: float,
                 group_of: Callable[[], int | None] = lambda: None,
                 lease_ttl_s: float = 0.0) -> None:
        super().__init__(name=f"checkpointless-heartbeat-{node}", daemon=True)
        self._addr = address
        self._node = node
        self._key = protocol.agent_heartbeat_key(node)
        self._interval = interval_s
        self._group_of = group_of
        self._lease_ttl = lease_ttl_s  # > 0 with etcd: hold a lease (see the module doc)
        self._stop_event = threading.Event()
        #: monotonic time the beat in progress started writing; None between beats.
        self.blocked_since: float | None = None

    def run(self) -> None:
        try:
            if self._addr.is_etcd:
                store = store_address.connect(self._addr, OP_TIMEOUT_S)
            else:
                store = connect_store(*self._addr.endpoints[0], timeout_s=OP_TIMEOUT_S)
            lease = self._grant(store)
            seq = 0
            last = time.monotonic()
            while not self._stop_event.wait(self._interval):
                now = time.monotonic()
                if now - last > HEARTBEAT_LATE_FACTOR * self._interval + 1.0:
                    # Peers may be about to declare us lost: say so on the console, with
                    # the gap, so a false node loss can be told from a real one.
                    print(f"[checkpointless node {self._node}] heartbeat late by "
                          f"{now - last - self._interval:.1f}s (this agent was not "
                          "scheduled, or its store connection stalled)",
                          file=sys.stderr, flush=True)
                last = now
                seq += 1
                if self.blocked_since is None:
                    self.blocked_since = now
                try:
                    auth.put(store, self._key, str(seq))
                    if lease is not None:
                        lease = self._renew(store, lease)
                    group = self._group_of()
                    if group is not None:
                        reassert_owner(store, group, self._node)
                    protocol.reassert_generations(store)
                except dist.DistStoreError as exc:
                    if not self._addr.is_etcd:
                        raise
                    # etcd without quorum, or every member unreachable for a while: the
                    # next beat tries again (blocked_since stays set: the StoreLease
                    # decides whether this node is cut off). With c10d a dead store is
                    # the end of the job, and the main loop says so.
                    print(f"[checkpointless node {self._node}] heartbeat not written: "
                          f"{exc}", file=sys.stderr, flush=True)
                    continue
                self.blocked_since = None
        except (StoreUnavailable, dist.DistError, RuntimeError):
            # The main loop notices a dead store on its own next operation; a beat left
            # unwritten (blocked_since stays set) is what the StoreLease watches for.
            return

    def _grant(self, store: dist.Store) -> int | None:
        if self._lease_ttl <= 0:
            return None
        lease = store.grant_lease(max(1, round(self._lease_ttl)))  # type: ignore[attr-defined]
        self._put_alive(store, lease)
        return lease

    def _renew(self, store: dist.Store, lease: int) -> int:
        """Keep the lease alive and put the record back (a forger may have deleted it);
        a lease that expired meanwhile (this agent was stopped for a whole TTL, so its
        peers may already have declared it lost) is replaced by a new one."""
        from recovery.etcd_store import EtcdLeaseExpired

        try:
            store.keepalive(lease)  # type: ignore[attr-defined]
        except EtcdLeaseExpired:
            return self._grant(store) or lease
        self._put_alive(store, lease)
        return lease

    def _put_alive(self, store: dist.Store, lease: int) -> None:
        key = protocol.agent_lease_key(self._node)
        sealed = signing.process_signer().seal(key, str(lease))
        store.set_with_lease(key, sealed, lease)  # type: ignore[attr-defined]

    def stop(self) -> None:
        """Stop beating; wait (briefly) for the thread to close its store connection."""
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=2.0)


class StoreLease(threading.Thread):
    """Stops this node's workers once its heartbeat has been stuck for ``timeout_s``.

    The other agents declare this node lost when its heartbeat has not grown for
    ``timeout_s`` on their clocks, and a spare node may then run its ranks. A node cut
    off from the network (no FIN, no RST: its connections just go quiet) learns nothing
    of this: every store operation of its agent blocks for up to the store's operation
    timeout, and its workers wait in collectives and store reads. Its heartbeat is a
    lease: when a beat has been in flight for ``timeout_s`` without reaching the store,
    this node must assume it has been declared lost and fence itself at once, from this
    thread (the main loop is blocked in the store), before the link can come back and
    its workers' stale writes or collectives reach the job (ADR 0021).

    A beat that cannot be *written* is the sign, not a beat that was written late: an
    agent that was not scheduled (SIGSTOP, an overloaded host) writes its next beat at
    once when it wakes, and keeps its workers (ADR 0010, addendum). Time this watch
    itself was not scheduled does not count either, as in :meth:`PeerWatch.check`.
    Nor does a store host that is only slow (a starved agent 0 answers nobody for
    seconds): before it fences, the lease asks ``reachable`` (a plain TCP connect to the
    store, which the store host's kernel answers however busy the process is), and a
    store that accepts keeps the lease.
    """

    #: How often a stuck beat asks whether the store host is reachable at all.
    PROBE_EVERY_S = 1.0

    def __init__(self, heartbeat: Heartbeat, timeout_s: float,
                 on_lost: Callable[[float], None], reachable: Callable[[], bool],
                 interval_s: float = 0.2) -> None:
        super().__init__(name="checkpointless-store-lease", daemon=True)
        self._heartbeat = heartbeat
        self._timeout = timeout_s
        self._on_lost = on_lost
        self._reachable = reachable
        self._interval = interval_s
        self._stop_event = threading.Event()

    def run(self) -> None:
        looked = counted_from = time.monotonic()
        next_probe = 0.0
        while not self._stop_event.wait(self._interval):
            now = time.monotonic()
            if now - looked > self._timeout / 2:
                counted_from = now  # this thread was not scheduled: the gap proves nothing
            looked = now
            since = self._heartbeat.blocked_since
            if since is None or now - max(since, counted_from) <= self._timeout:
                continue
            if now < next_probe:
                continue
            next_probe = now + self.PROBE_EVERY_S
            if self._reachable():
                continue  # the store host's kernel answers: slow, not cut off
            if self._heartbeat.blocked_since == since and not self._stop_event.is_set():
                self._on_lost(time.monotonic() - since)
                # Once per stuck beat: watch again when a beat goes through (the node may
                # be back and keep running, say as a spare node) and then gets stuck.
                while (self._heartbeat.blocked_since == since
                       and not self._stop_event.wait(self._interval)):
                    pass
                looked = counted_from = time.monotonic()

    def stop(self) -> None:
        self._stop_event.set()


@dataclass
class _Peer:
    seq: int  # the newest validly sealed heartbeat sequence number seen (-1: none yet)
    changed_at: float  # monotonic time this agent last saw the sequence grow
    gen_alive: int  # the generation current when the peer was last seen alive


@dataclass
class PeerWatch:
    """Decides which other agents are lost, each exactly once.

    A peer is lost when its sealed heartbeat sequence has not grown for ``timeout_s`` on
    this agent's clock. A newly seen peer gets a full timeout of grace. ``gen_alive``
    records the generation this agent read (before reading the heartbeats) when the peer
    last showed life: a node's loss belongs to that generation, not to one a survivor may
    have declared meanwhile, so detectors that arrive late dedupe instead of adding one.
    A value that does not verify, or an old one written back, is no sign of life.
    """

    node: int
    timeout_s: float
    #: With etcd leases: a peer whose lease-bound "alive" record is gone is lost once its
    #: counter has also not grown for this long (a forged delete cannot pass for a loss:
    #: a live peer's counter keeps growing). 0: no leases, the timeout alone decides.
    lease_confirm_s: float = 0.0
    peers: dict[int, _Peer] = field(default_factory=dict)
    lost: set[int] = field(default_factory=set)
    last_check: float | None = None

    def check(self, store: dist.Store, gen: int) -> list[int]:
        """Read every peer's heartbeat; return the nodes that became lost just now.

        Time this agent could not look does not count as the peers' silence: when the
        previous check is more than half a timeout ago (this process was not scheduled,
        or the store answered slowly; the store host's own stall freezes every
        heartbeat at once), every peer's silence restarts now. Otherwise a starved
        store host would declare every other node lost the moment it woke up.
        """
        now = time.monotonic()
        if self.last_check is not None and now - self.last_check > self.timeout_s / 2:
            for peer in self.peers.values():
                peer.changed_at = max(peer.changed_at, now)
        self.last_check = now
        listed = set(registered_nodes(store)) | set(self.peers)  # a wiped list forgets none
        nodes = sorted(n for n in listed if n != self.node and n not in self.lost)
        if not nodes:
            return []
        keys = [protocol.agent_heartbeat_key(n) for n in nodes]
        alive = [protocol.agent_lease_key(n) for n in nodes] if self.lease_confirm_s else []
        values = store.multi_get(keys)
        # Lease-bound records vanish on expiry: read without waiting for them.
        present = store.read_now(alive) if alive else []  # type: ignore[attr-defined]
        newly = []
        for i, (n, key) in enumerate(zip(nodes, keys)):
            payload = auth.open_value(key, values[i])
            seq = int(payload) if payload is not None else None
            peer = self.peers.get(n)
            if peer is None:
                self.peers[n] = _Peer(-1 if seq is None else seq, now, gen)
            elif seq is not None and seq > peer.seq:
                peer.seq, peer.changed_at, peer.gen_alive = seq, now, gen
            elif now - peer.changed_at > self.timeout_s or (
                alive and peer.seq >= 0 and present[i] is None
                and now - peer.changed_at > self.lease_confirm_s
            ):
                self.lost.add(n)
                newly.append(n)
        return newly

    def returned(self, store: dist.Store, node: int, gen: int) -> bool:
        """True if ``node``, declared lost, has heartbeated since: it was only slow
        (a starved agent). It is watched again from now on."""
        peer = self.peers.get(node)
        if node not in self.lost or peer is None:
            return False
        key = protocol.agent_heartbeat_key(node)
        payload = auth.open_value(key, store.multi_get([key])[0])
        if payload is None or int(payload) <= peer.seq:
            return False
        peer.seq, peer.changed_at, peer.gen_alive = int(payload), time.monotonic(), gen
        self.lost.discard(node)
        return True

    def gen_alive(self, node: int, default: int) -> int:
        peer = self.peers.get(node)
        return default if peer is None else peer.gen_alive

    def silent_for(self, node: int) -> float:
        peer = self.peers.get(node)
        return 0.0 if peer is None else time.monotonic() - peer.changed_at


class DoneWatch:
    """Tells when every rank has finished, from their sealed "done" records.

    Only an agent that runs no workers any more (its ranks are done, or it is a spare
    node) looks, at most every ``recheck_s``: while one of its own ranks runs, the job
    cannot be over, and a busy job never pays for the check.
    """

    def __init__(self, world_size: int, recheck_s: float = 0.1) -> None:
        self.world_size = world_size
        self.recheck_s = recheck_s
        self._next_check = 0.0

    def all_done(self, store: dist.Store, idle: bool) -> bool:
        now = time.monotonic()
        if not idle or now < self._next_check:
            return False
        self._next_check = now + self.recheck_s
        return protocol.all_done(store, self.world_size)

    def finished(self, store: dist.Store) -> int:
        """How many ranks finished (one read when none has)."""
        if not protocol.any_done(store):
            return 0
        return len(protocol.done_ranks(store, self.world_size))
