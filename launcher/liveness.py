"""Which agents are alive: this agent's heartbeat, its watch over a few others, and the
watch for every rank having finished.

Liveness costs O(nodes) for the job, not O(nodes²) (ADR 0023): each agent watches only
its next :data:`WATCHERS` nodes in the ring of registered nodes, the watch moves on past
a lost node, and the agent that detects a loss publishes it (sealed, ``LOST_KEY``) for
every other agent to learn. A check reads 3 keys whatever the job's size (5 with etcd);
the agents list and the published losses only when the liveness version changed.

``agent_heartbeat_key(n)`` is a counter that agent ``n``'s heartbeat thread bumps.
With an etcd job store the thread also holds an etcd lease whose time-to-live is the
heartbeat timeout and keeps a sealed "alive" record bound to it
(``agent_lease_key(n)``): etcd deletes the record when the agent stops renewing, on the
cluster's clock, and a watcher then needs only one quick confirmation that the counter
stopped too (:class:`PeerWatch`), instead of a whole timeout of silence of its own.
Observers judge liveness by *change* of the value, timed on their own monotonic clock,
so no two machines' clocks are ever compared. Heartbeats are sealed sequence numbers
(:mod:`recovery.job_store.auth`), so a forger can neither fake a beat for a dead node nor make a
live one look silent by writing an old value back. The heartbeat thread also puts back
this agent's owner record (:func:`launcher.membership.reassert_owner`) and the
generation records if something overwrote them (``docs/security.md`` says what remains
possible).
"""

from __future__ import annotations

import bisect
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist

from launcher.job_store import OP_TIMEOUT_S, StoreUnavailable, connect_store
from launcher.membership import agent_info, reassert_owner, registered_nodes
from launcher.peer_link import PeerLinks
from recovery.generation import protocol, world
from recovery.job_store import auth, store_address
from recovery.job_store.store_address import StoreAddress
from replication.side_channel import signing

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
                # not capturing fd 2: the main thread is printing meanwhile
                store = connect_store(*self._addr.endpoints[0], timeout_s=OP_TIMEOUT_S,
                                      capture_log=False)
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
        from recovery.job_store.etcd_store import EtcdLeaseExpired

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


#: How many peers each agent watches, and so how many agents watch each node: two, so
#: that one watcher that is slow (not scheduled, a store read that stalls) or lost
#: together with the node does not delay the detection, while an agent's cost per
#: check stays constant however many nodes the job has (ADR 0023).
WATCHERS = 2
#: A watcher re-reads the agents list and the published losses when the liveness
#: version changed, and at least every this many checks (a forger can write an old
#: version back; the re-read bounds what that delays).
REFRESH_EVERY = 30


@dataclass
class _Peer:
    seq: int  # the newest validly sealed heartbeat sequence number seen (-1: none yet)
    changed_at: float  # monotonic time this agent last saw the sequence grow
    gen_alive: int  # the generation current when the peer was last seen alive
    by: int | None = None  # for a lost peer: the agent that detected it (None: this one)


@dataclass
class PeerWatch:
    """Decides which other agents are lost, each exactly once, watching only a few.

    The registered nodes form a ring (sorted ids, wrapping around). This agent watches
    the next :data:`WATCHERS` nodes after itself that it does not know to be lost, so
    every node has that many watchers. When a watched node is lost, the watch moves on
    to the next live node (the takeover of the watch): a run of consecutive lost nodes
    is still detected, a timeout later at most for each node beyond the watchers' reach.

    A watched peer is lost when its sealed heartbeat sequence has not grown for
    ``timeout_s`` on this agent's clock. A peer that enters the watch gets a full
    timeout of grace. ``gen_alive`` records the generation this agent read (before
    reading the heartbeats) when the peer last showed life: a node's loss belongs to
    that generation, not to one a survivor may have declared meanwhile, so detectors
    that arrive late dedupe instead of adding one. A value that does not verify, or an
    old one written back, is no sign of life.

    The detector publishes each loss (``protocol.LOST_KEY``, sealed) and every other
    agent learns it from there: that is how a spare node hears of a loss it does not
    watch. A learner first reads the lost node's heartbeat once: if it grew past the
    sequence the detector last saw, the node was alive after all and the record is
    ignored. A forged record does not verify, and an old one written back names a
    sequence the node has passed.

    What one check reads (keys, not bytes), at any job size: the liveness version (a
    compare-and-set from "absent", which never waits) and the watched nodes' heartbeats
    in one ``multi_get``: 1 + :data:`WATCHERS` = 3 keys in two round trips; with etcd
    also their lease records (2 more keys, one more round trip). Only when the version
    changed, or every :data:`REFRESH_EVERY` checks: the agents list and the published
    losses (2 keys, whose size grows with nodes and losses), and one heartbeat per newly
    published loss. Before (every agent watched every other): nodes - 1 heartbeats and
    the agents list each check, so O(nodes) per agent and O(nodes²) for the job.
    """

    node: int
    timeout_s: float
    #: With etcd leases: a peer whose lease-bound "alive" record is gone is lost once its
    #: counter has also not grown for this long (a forged delete cannot pass for a loss:
    #: a live peer's counter keeps growing). 0: no leases, the timeout alone decides.
    lease_confirm_s: float = 0.0
    #: A watched peer whose connection (:mod:`launcher.peer_link`) ended is lost once
    #: its counter has also not grown for this long, unless its agent said it finished.
    #: None: no connections, the timeout alone decides.
    links: PeerLinks | None = None
    link_confirm_s: float = 2.0
    watchers: int = WATCHERS
    peers: dict[int, _Peer] = field(default_factory=dict)
    lost: set[int] = field(default_factory=set)
    last_check: float | None = None
    #: Every node registered so far, sorted (a wiped agents list forgets none).
    ring: list[int] = field(default_factory=list)
    #: The nodes this agent watches now.
    watched: list[int] = field(default_factory=list)
    _version: bytes | None = None
    _checks_since_refresh: int = 0
    _entries_seen: set[bytes] = field(default_factory=set)
    _link_of: dict[int, str] = field(default_factory=dict)
    #: Lost nodes whose connection ended before their heartbeat timed out.
    link_ended: set[int] = field(default_factory=set)

    def check(self, store: dist.Store, gen: int, publish: bool = True) -> list[int]:
        """Read the watched peers' heartbeats (and, when they changed, the published
        losses); return the nodes that became lost just now, detected or learned.

        Newly detected losses are published unless ``publish`` is False (the store host
        lingering at the end of the job, whose peers stop beating as they leave).

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
        newly: list[int] = []
        self._checks_since_refresh += 1
        # compare-and-set from "absent": the current version, never a wait (a forger may
        # have deleted it; then this recreates it and everyone re-reads once).
        version = bytes(store.compare_set(protocol.LIVENESS_VERSION_KEY, b"",
                                          uuid.uuid4().hex.encode()))
        if version != self._version or self._checks_since_refresh >= REFRESH_EVERY:
            newly += self._refresh(store, gen, now, version)
        nodes = list(self.watched)
        if not nodes:
            return sorted(newly)
        keys = [protocol.agent_heartbeat_key(n) for n in nodes]
        values = store.multi_get(keys)
        alive = [protocol.agent_lease_key(n) for n in nodes] if self.lease_confirm_s else []
        # Lease-bound records vanish on expiry: read without waiting for them.
        present = store.read_now(alive) if alive else []  # type: ignore[attr-defined]
        ended = self._links_ended(store, nodes)
        detected = [n for i, n in enumerate(nodes)
                    if self._observe(n, keys[i], values[i], present[i] if alive else b"",
                                     now, gen, ended.get(n))]
        if detected:
            if publish:
                self._entries_seen.update(protocol.publish_losses(store, [
                    protocol.LostRecord(n, self.peers[n].seq, self.peers[n].gen_alive,
                                        now - self.peers[n].changed_at, self.node)
                    for n in detected]))
            self._rewatch(now, gen)  # the takeover of the watch
        return sorted(newly + detected)

    def _links_ended(self, store: dist.Store, nodes: list[int]) -> dict[int, float]:
        """Hold a connection to each watched node (addresses from their sealed membership
        records); return when those that ended did, for nodes whose agent did not say it
        finished (an agent that finished closes its connections too)."""
        if self.links is None:
            return {}
        addresses = {}
        for n in nodes:
            info = agent_info(store, n) if n not in self._link_of else None
            if info is not None and info.get("link"):
                self._link_of[n] = str(info["link"])
            if n in self._link_of:
                addresses[n] = self._link_of[n]
        self.links.watch(addresses)
        ended = {n: t for n in nodes if (t := self.links.closed_at(n)) is not None}
        for n in [n for n, t in ended.items() if self.peers[n].changed_at > t]:
            self.links.reconnect(n)  # it beat after its connection ended: alive, link again
            del ended[n]
        return {n: t for n, t in ended.items() if not protocol.agent_finished(store, n)}

    def _observe(self, n: int, key: str, raw: bytes, alive_record: bytes | None,
                 now: float, gen: int, link_ended: float | None = None) -> bool:
        """Take one watched peer's heartbeat in; True if it is lost just now."""
        payload = auth.open_value(key, raw)
        seq = int(payload) if payload is not None else None
        peer = self.peers[n]
        if seq is not None and seq > peer.seq:
            if peer.seq >= 0:  # the first value read is no sign of life: grace runs on
                peer.changed_at, peer.gen_alive = now, gen
            peer.seq = seq
            return False
        if now - peer.changed_at > self.timeout_s or (
            alive_record is None and peer.seq >= 0
            and now - peer.changed_at > self.lease_confirm_s
        ) or (
            link_ended is not None and now - max(link_ended, peer.changed_at)
            > self.link_confirm_s
        ):
            self.lost.add(n)
            if link_ended is not None and now - peer.changed_at <= self.timeout_s:
                self.link_ended.add(n)  # the evidence was its connection's end
            return True
        return False

    def _refresh(self, store: dist.Store, gen: int, now: float, version: bytes) -> list[int]:
        """Re-read the ring and the published losses (read the version first: a change
        after it changes the version again); return the losses learned just now."""
        self._version, self._checks_since_refresh = version, 0
        self.ring = sorted(set(registered_nodes(store)) | set(self.ring))
        entries = [e for e in protocol.sealed_list_entries(auth.read_raw(store, protocol.LOST_KEY))
                   if e not in self._entries_seen]
        self._entries_seen.update(entries)
        records = {}
        for entry in entries:
            rec = protocol.open_lost_entry(entry)
            if rec is None or rec.node == self.node or rec.node in self.lost:
                continue
            peer = self.peers.get(rec.node)
            if peer is not None and peer.seq > rec.seq:
                continue  # this agent saw it beat after the detector last did
            records[rec.node] = rec
        learned = self._learn(store, list(records.values()), now)
        self._rewatch(now, gen)
        return learned

    def _learn(self, store: dist.Store, records: list[protocol.LostRecord],
               now: float) -> list[int]:
        """Take in published losses whose node has not beaten since (one read for all)."""
        if not records:
            return []
        keys = [protocol.agent_heartbeat_key(r.node) for r in records]
        beats = store.multi_get(keys)
        learned = []
        for rec, key, raw in zip(records, keys, beats):
            payload = auth.open_value(key, raw)
            if payload is not None and int(payload) > rec.seq:
                continue  # it beat after the detector's last look: alive (or back)
            self.lost.add(rec.node)
            self.peers[rec.node] = _Peer(rec.seq, now - rec.silent_s, rec.gen_alive, rec.by)
            learned.append(rec.node)
        return learned

    def _rewatch(self, now: float, gen: int) -> None:
        """Watch the next live nodes in the ring; a node entering the watch (a new one,
        or the next one after a lost node) gets a full timeout of grace."""
        others = [n for n in self.ring if n != self.node and n not in self.lost]
        start = bisect.bisect_right(others, self.node)
        ring = others[start:] + others[:start]
        watched = ring[:self.watchers]
        for n in watched:
            if n in self.watched:
                continue
            peer = self.peers.get(n)
            if peer is None:
                self.peers[n] = _Peer(-1, now, gen)
            else:
                peer.changed_at, peer.gen_alive, peer.by = now, gen, None
        self.watched = watched

    def returned(self, store: dist.Store, node: int, gen: int) -> bool:
        """True if ``node``, declared lost, has heartbeated since: it was only slow
        (a starved agent). It is back in the ring from now on."""
        peer = self.peers.get(node)
        if node not in self.lost or peer is None:
            return False
        key = protocol.agent_heartbeat_key(node)
        payload = auth.open_value(key, store.multi_get([key])[0])
        if payload is None or int(payload) <= peer.seq:
            return False
        peer.seq, peer.changed_at, peer.gen_alive = int(payload), time.monotonic(), gen
        peer.by = None
        self.lost.discard(node)
        self._rewatch(time.monotonic(), gen)
        return True

    def gen_alive(self, node: int, default: int) -> int:
        peer = self.peers.get(node)
        return default if peer is None else peer.gen_alive

    def silent_for(self, node: int) -> float:
        peer = self.peers.get(node)
        return 0.0 if peer is None else time.monotonic() - peer.changed_at

    def detected_by(self, node: int) -> int:
        """The agent that detected ``node``'s loss: this one, or the one whose published
        record this agent learned it from."""
        peer = self.peers.get(node)
        return self.node if peer is None or peer.by is None else peer.by


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
        # The launch ranks that train now: a shrunk job is done without its retired ones.
        slots = world.current(store, 1 << 62, self.world_size).slots
        values = auth.read_all(store, [protocol.done_key(r) for r in slots])
        return values is not None and all(v is not None for v in values)

    def finished(self, store: dist.Store) -> int:
        """How many ranks finished (one read when none has)."""
        if not protocol.any_done(store):
            return 0
        return len(protocol.done_ranks(store, self.world_size))
