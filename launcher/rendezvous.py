"""The agents' meeting point: the job's TCPStore, registration, heartbeats, group owners.

Node 0's agent hosts the store; every other agent (and every worker) is a client.
Agents then coordinate only through keys from :mod:`recovery.protocol`:

- ``AGENTS_KEY`` lists every agent that ever joined, so any agent can watch all others;
- ``agent_heartbeat_key(n)`` is a counter that agent ``n``'s heartbeat thread bumps.
  Observers judge liveness by *change* of the value, timed on their own monotonic
  clock, so no two machines' clocks are ever compared;
- ``group_owner_key(g)`` names the agent that runs group ``g``'s ranks. Ownership is
  moved with a compare-and-set from the lost owner's id, which makes the takeover of a
  lost node's ranks exclusive without depending on which generation each claimer saw.

Limitation (shared with torchrun's c10d backend): the store lives in node 0's agent, so
losing node 0 ends the job; every agent then reports a lost store instead of hanging.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from recovery import protocol

#: Per-operation timeout once connected: long enough for a busy store, short enough
#: that an agent never waits forever on a stopped one.
OP_TIMEOUT_S = 30.0


class StoreUnavailable(RuntimeError):
    """The job's store cannot be hosted or reached, or went away."""


def host_store(host: str, port: int) -> dist.TCPStore:
    """Start the job's store server (node 0). ``port`` 0 picks a free port."""
    try:
        store = dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=OP_TIMEOUT_S),
        )
    except (dist.DistError, RuntimeError) as exc:
        raise StoreUnavailable(
            f"cannot host the job store on {host}:{port}: {brief(exc)}"
        ) from None
    protocol.init_generation(store)
    return store


def connect_store(
    host: str, port: int, timeout_s: float, should_stop: Callable[[], bool] = lambda: False
) -> dist.TCPStore:
    """Connect as a client, waiting up to ``timeout_s`` for node 0 to start its store.

    The wait probes the port with plain sockets first: that is quiet (c10d logs every
    failed attempt with a stack trace) and can be interrupted between probes by
    ``should_stop`` (a signal), where a blocking c10d connect could not.
    """
    deadline = time.monotonic() + timeout_s
    while not _accepts(host, port):
        if should_stop():
            raise StoreUnavailable("interrupted while waiting for the job store")
        if time.monotonic() > deadline:
            raise StoreUnavailable(
                f"cannot reach the job store at {host}:{port} within {timeout_s:.0f}s "
                "(is the node-rank 0 agent running?)"
            )
        time.sleep(0.2)
    try:
        store = dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=OP_TIMEOUT_S)
        )
    except (dist.DistError, RuntimeError) as exc:
        raise StoreUnavailable(f"cannot connect to the job store at {host}:{port}: "
                               f"{brief(exc)}") from None
    protocol.init_generation(store)
    return store


def _accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1.0).close()
        return True
    except OSError:
        return False


def brief(exc: BaseException) -> str:
    """The first line of a c10d error (the rest is a C++ stack trace)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def register(store: dist.Store, node: int, nproc: int, spare: bool) -> None:
    """Publish this agent; its heartbeat key exists before anyone can list it."""
    info = {"node": node, "host": socket.gethostname(), "pid": os.getpid(),
            "nproc": nproc, "spare": spare}
    store.set(protocol.agent_info_key(node), json.dumps(info))
    store.add(protocol.agent_heartbeat_key(node), 1)
    store.append(protocol.AGENTS_KEY, f"{node},")


def registered_nodes(store: dist.Store) -> list[int]:
    if not store.check([protocol.AGENTS_KEY]):
        return []
    raw = store.get(protocol.AGENTS_KEY).decode()
    return sorted({int(part) for part in raw.split(",") if part})


def agent_info(store: dist.Store, node: int) -> dict | None:
    return protocol.read_json(store, protocol.agent_info_key(node))


def own_group(store: dist.Store, group: int, node: int) -> bool:
    """Claim group ``group`` at launch; False if some agent already owns it."""
    key = protocol.group_owner_key(group)
    return store.compare_set(key, "", str(node)).decode() == str(node)


def take_over(store: dist.Store, group: int, lost: int, node: int) -> bool:
    """Move ``group`` from the lost node to this one; exactly one claimer wins."""
    key = protocol.group_owner_key(group)
    return store.compare_set(key, str(lost), str(node)).decode() == str(node)


def owner(store: dist.Store, group: int) -> int | None:
    key = protocol.group_owner_key(group)
    return int(store.get(key).decode()) if store.check([key]) else None


def owners(store: dist.Store, ngroups: int) -> dict[int, int | None]:
    """group -> owning node (None while a group has no owner yet, before the launch)."""
    keys = [protocol.group_owner_key(g) for g in range(ngroups)]
    present = [g for g, k in enumerate(keys) if store.check([k])]
    values = store.multi_get([keys[g] for g in present]) if present else []
    found = {g: int(v.decode()) for g, v in zip(present, values)}
    return {g: found.get(g) for g in range(ngroups)}


def committed_step(store: dist.Store) -> int | str | None:
    """The newest committed step, if the runtime recorded one (its format is its own)."""
    if not store.check([protocol.COMMITTED_KEY]):
        return None
    raw = store.get(protocol.COMMITTED_KEY).decode()
    return int(raw) if raw.strip().lstrip("-").isdigit() else raw


def wait_for_groups(
    store: dist.Store, ngroups: int, nproc: int, timeout_s: float, should_stop: Callable[[], bool]
) -> str | None:
    """Wait until every group has an agent (torchrun's rendezvous); the problem, if any.

    Returns None when all groups are owned by agents with the same ``nproc`` (or when
    ``should_stop`` or the fatal flag ends the wait: the caller checks those).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if should_stop() or protocol.fatal(store) is not None:
            return None
        found = owners(store, ngroups)
        missing = [g for g, node in found.items() if node is None]
        if not missing:
            break
        if time.monotonic() > deadline:
            return f"node ranks {missing} did not join within {timeout_s:.0f}s"
        time.sleep(0.1)
    for node in sorted(set(found.values())):
        info = agent_info(store, node)
        if info and int(info["nproc"]) != nproc:
            return (f"node {node} runs {info['nproc']} workers per node but another runs "
                    f"{nproc}: every agent needs the same --nproc-per-node")
    return None


class Heartbeat(threading.Thread):
    """Bumps this agent's heartbeat counter on its own connection.

    A separate client keeps beats flowing while the main loop waits on the store (a
    ``declare_failure`` can take a while), and avoids sharing one socket between threads.
    """

    def __init__(self, host: str, port: int, node: int, interval_s: float) -> None:
        super().__init__(name=f"checkpointless-heartbeat-{node}", daemon=True)
        self._addr = (host, port)
        self._key = protocol.agent_heartbeat_key(node)
        self._interval = interval_s
        self._stop_event = threading.Event()

    def run(self) -> None:
        try:
            store = connect_store(*self._addr, timeout_s=OP_TIMEOUT_S)
            while not self._stop_event.wait(self._interval):
                store.add(self._key, 1)
        except (StoreUnavailable, dist.DistError, RuntimeError):
            return  # the main loop notices a dead store on its own next operation

    def stop(self) -> None:
        self._stop_event.set()


@dataclass
class _Peer:
    value: bytes
    changed_at: float  # monotonic time this agent last saw the counter change
    gen_alive: int  # the generation current when the peer was last seen alive


@dataclass
class PeerWatch:
    """Decides which other agents are lost, each exactly once.

    A peer is lost when its heartbeat counter has not changed for ``timeout_s`` on this
    agent's clock. A newly seen peer gets a full timeout of grace. ``gen_alive`` records
    the generation this agent read (before reading the counters) when the peer last
    showed life: a node's loss belongs to that generation, not to one a survivor may have
    declared meanwhile, so detectors that arrive late dedupe instead of adding one.
    """

    node: int
    timeout_s: float
    peers: dict[int, _Peer] = field(default_factory=dict)
    lost: set[int] = field(default_factory=set)

    def check(self, store: dist.Store, gen: int) -> list[int]:
        """Read every peer's counter; return the nodes that became lost just now."""
        now = time.monotonic()
        nodes = [n for n in registered_nodes(store) if n != self.node and n not in self.lost]
        if not nodes:
            return []
        values = store.multi_get([protocol.agent_heartbeat_key(n) for n in nodes])
        newly = []
        for n, value in zip(nodes, values):
            peer = self.peers.get(n)
            if peer is None or peer.value != value:
                self.peers[n] = _Peer(value, now, gen)
            elif now - peer.changed_at > self.timeout_s:
                self.lost.add(n)
                newly.append(n)
        return newly

    def gen_alive(self, node: int, default: int) -> int:
        peer = self.peers.get(node)
        return default if peer is None else peer.gen_alive

    def silent_for(self, node: int) -> float:
        peer = self.peers.get(node)
        return 0.0 if peer is None else time.monotonic() - peer.changed_at
