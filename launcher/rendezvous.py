"""The agents' meeting point: the job's TCPStore, registration, heartbeats, group owners.

Node 0's agent hosts the store; every other agent (and every worker) is a client.
Agents then coordinate only through keys from :mod:`recovery.protocol`:

- ``AGENTS_KEY`` lists every agent that ever joined, so any agent can watch all others;
- ``agent_heartbeat_key(n)`` is a counter that agent ``n``'s heartbeat thread bumps.
  Observers judge liveness by *change* of the value, timed on their own monotonic
  clock, so no two machines' clocks are ever compared;
- ``group_owner_key(g)`` names the agent that runs group ``g``'s ranks. Ownership is
  moved with a compare-and-set from the lost owner's record, which makes the takeover of
  a lost node's ranks exclusive without depending on which generation each claimer saw.

Every one of these values is sealed with the job key (:mod:`recovery.auth`): a process
without the job secret can write into the store, but no agent acts on what it writes.
Heartbeats are sealed sequence numbers, so a forger can neither fake a beat for a dead
node nor make a live one look silent by writing an old value back; owner records carry
an epoch that grows with each takeover, so an old one written back is recognised. The
heartbeat thread also puts back this agent's owner record and the generation records
if something overwrote them (``docs/security.md`` says what remains possible).

Limitation (shared with torchrun's c10d backend): the store lives in node 0's agent, so
losing node 0 ends the job; every agent then reports a lost store instead of hanging.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from launcher import bind as bind_mod
from launcher import job_secret
from launcher.run_args import RunArgs
from recovery import auth, protocol
from replication import signing
from replication.commit import UntrustedCommit
from replication.commit import committed_step as _committed_step
from replication.signing import Signer

#: Per-operation timeout once connected: long enough for a busy store, short enough
#: that an agent never waits forever on a stopped one.
OP_TIMEOUT_S = 30.0


class StoreUnavailable(RuntimeError):
    """The job's store cannot be hosted or reached, or went away."""


def host_store(host: str, port: int, address: str | None = None) -> dist.TCPStore:
    """Start the job's store server (node 0). ``port`` 0 picks a free port.

    ``address``: listen there only (c10d's server itself always listens on every
    interface, so we bind the socket and hand it over with ``master_listen_fd``); None
    listens on every interface. The store host then publishes the sealed key check.
    """
    timeout = timedelta(seconds=OP_TIMEOUT_S)
    try:
        if address is None:
            store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                  timeout=timeout)
        else:
            sock = bind_mod.listening_socket(address, port)
            bound = sock.getsockname()[1]
            fd = sock.detach()  # the store owns the descriptor from here on
            try:
                store = dist.TCPStore(address, bound, is_master=True, wait_for_workers=False,
                                      timeout=timeout, master_listen_fd=fd)
            except BaseException:
                os.close(fd)
                raise
    except OSError as exc:
        raise StoreUnavailable(f"cannot host the job store on {address or host}:{port}: "
                               f"{exc.strerror or exc}") from None
    except (dist.DistError, RuntimeError) as exc:
        raise StoreUnavailable(
            f"cannot host the job store on {address or host}:{port}: {brief(exc)}"
        ) from None
    protocol.publish_keycheck(store)
    return store


@dataclass
class JobStore:
    """The job store as this agent reached it, with what it authenticates with."""

    store: dist.TCPStore
    port: int
    signer: Signer
    plan: bind_mod.BindPlan
    shared_secret_file: str | None = None  # left for this machine's other agents

    def release(self) -> None:
        """Remove the secret file this agent left (the job is over)."""
        if self.shared_secret_file:
            with contextlib.suppress(OSError):
                os.unlink(self.shared_secret_file)


def open_job_store(args: RunArgs, run_dir: str, should_stop: Callable[[], bool],
                   say: Callable[[str], None] = lambda _m: None) -> JobStore:
    """Host (node 0) or join the job store, with the job key installed for this process.

    The secret comes from ``args`` (``run_args.prepare``); without one, node 0 generates
    it and, when every agent runs on this machine, leaves it in the run directory for
    the others, who read it once the store is reachable. A joining agent then checks its
    key against the store host's before it writes anything.
    """
    plan = args.bind_plan or bind_mod.choose(
        args.bind, args.host, args.port, args.hosts_store,
        multi_node=args.nnodes > 1 or args.node_rank > 0)
    secret, shared = args.job_secret, None
    if args.hosts_store:
        if secret is None:
            secret = job_secret.generate()
            if bind_mod.is_local_only(args.host) and not args.standalone:  # others may join
                shared = job_secret.share_locally(run_dir, secret)
        signing.install(job_secret.signer_for(secret, args.rdzv_id))
        store = host_store(args.host, args.port, plan.address)
        return JobStore(store, store.port, signing.process_signer(), plan, shared)
    store = connect_store(args.host, args.port, args.join_timeout_s, should_stop, say)
    if secret is None:
        try:
            secret = job_secret.read_shared(run_dir, should_stop=should_stop)
        except job_secret.SecretError as exc:
            raise StoreUnavailable(str(exc)) from None
    signing.install(job_secret.signer_for(secret, args.rdzv_id))
    check_job_key(store, f"{args.host}:{args.port}")
    return JobStore(store, args.port, signing.process_signer(), plan)


#: How often a joining agent says it is still waiting for the job store.
WAIT_REPORT_S = 5.0
#: How long a port that accepts connections may take to answer as a c10d store.
HANDSHAKE_S = 10.0


def connect_store(
    host: str, port: int, timeout_s: float, should_stop: Callable[[], bool] = lambda: False,
    say: Callable[[str], None] = lambda _m: None,
) -> dist.TCPStore:
    """Connect as a client, waiting up to ``timeout_s`` for node 0 to start its store.

    The wait probes the port with plain sockets first: that is quiet (c10d logs every
    failed attempt with a stack trace), says every few seconds what it waits for, and
    can be interrupted between probes by ``should_stop`` (a signal), where a blocking
    c10d connect could not. The c10d handshake then runs on a helper thread: something
    else listening on the port (another service, a stale process) can leave it blocked
    in a native receive that no signal interrupts; this thread gives up on it after
    :data:`HANDSHAKE_S` with a line naming the likely cause, or at once on a signal.
    """
    where = f"{host}:{port}"
    start = time.monotonic()
    deadline, next_report = start + timeout_s, start + WAIT_REPORT_S
    while not _accepts(host, port):
        if should_stop():
            raise StoreUnavailable("interrupted while waiting for the job store")
        now = time.monotonic()
        if now > deadline:
            raise StoreUnavailable(
                f"cannot reach the job store at {where} within {timeout_s:.0f}s "
                "(is the node-rank 0 agent running?)"
            )
        if now >= next_report:
            say(f"waiting for the job store at {where} (node-rank 0's agent), "
                f"{now - start:.0f}s of {timeout_s:.0f}s")
            next_report = now + WAIT_REPORT_S
        time.sleep(0.2)
    return _handshake(host, port, should_stop)


def _handshake(host: str, port: int, should_stop: Callable[[], bool]) -> dist.TCPStore:
    where = f"{host}:{port}"
    box: dict[str, object] = {}

    def connect() -> None:
        try:
            box["store"] = dist.TCPStore(
                host, port, is_master=False, timeout=timedelta(seconds=OP_TIMEOUT_S))
        except (dist.DistError, RuntimeError) as exc:
            box["error"] = exc

    hint = ("is another service listening on that port? (--rdzv-endpoint must name the "
            "port of the node-rank 0 agent)")
    with _c10d_log_captured() as log_so_far:
        helper = threading.Thread(target=connect, name="checkpointless-store-connect",
                                  daemon=True)
        helper.start()
        deadline = time.monotonic() + HANDSHAKE_S
        while helper.is_alive():
            if should_stop():
                raise StoreUnavailable("interrupted while connecting to the job store")
            refused = _handshake_refusal(log_so_far())
            if refused is not None:  # c10d would retry this until its own timeout
                raise StoreUnavailable(f"the service at {where} is not a job store "
                                       f"(c10d handshake: {refused}): {hint}")
            if time.monotonic() > deadline:
                # The helper stays blocked; it is a daemon and holds nothing of ours.
                raise StoreUnavailable(
                    f"something at {where} accepts connections but did not answer as a "
                    f"job store within {HANDSHAKE_S:.0f}s: {hint}")
            helper.join(0.1)
    if "error" in box:
        raise StoreUnavailable(f"cannot connect to the job store at {where}: "
                               f"{brief(box['error'])} ({hint})") from None  # type: ignore[arg-type]
    return box["store"]  # type: ignore[return-value]


def _handshake_refusal(log: str) -> str | None:
    """The reason c10d gave for a failed connect-or-validate, when it is not a plain
    "connection refused" (which only means the store is not up yet)."""
    for line in reversed(log.splitlines()):
        if "failed to connect/validate" in line and "):" in line:
            reason = line.rsplit("):", 1)[1].strip()
            if reason and "refused" not in reason.lower():
                return reason
    return None


@contextlib.contextmanager
def _c10d_log_captured():
    """Send this process's stderr (fd 2) to a temporary file while c10d connects.

    c10d prints every retry of a failed handshake with a 25-frame C++ stack trace,
    straight to fd 2, for up to its whole timeout. Only this agent's start-up runs then
    (no worker, no other thread yet), so nothing else is hidden. Yields a function
    that returns what was captured so far.
    """
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            def so_far() -> str:
                tmp.seek(0)
                return tmp.read().decode(errors="replace")
            yield so_far
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def check_job_key(store: dist.Store, where: str, timeout_s: float = 10.0) -> None:
    """Stop (before writing anything) if this agent's job secret is not the job's."""
    deadline = time.monotonic() + timeout_s
    while (ok := protocol.keycheck(store)) is None:
        if time.monotonic() > deadline:
            raise StoreUnavailable(f"the job store at {where} has no key check record: it is "
                                   "not a checkpointless job store of this version")
        time.sleep(0.05)
    if not ok:
        raise StoreUnavailable(
            f"this agent's job secret is not the one the job at {where} was started with "
            "(CHECKPOINTLESS_JOB_SECRET / --job-secret-file must be the same on every node)")


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
    """Publish this agent; its heartbeat key exists before anyone can list it.

    The agents list is an append-only string of sealed entries between commas, so a
    forged or garbled entry (or a forger's unterminated text) spoils nothing but itself.
    """
    info = {"node": node, "host": socket.gethostname(), "pid": os.getpid(),
            "nproc": nproc, "spare": spare}
    auth.put(store, protocol.agent_info_key(node), json.dumps(info))
    auth.put(store, protocol.agent_heartbeat_key(node), "0")
    entry = signing.process_signer().seal(protocol.AGENTS_KEY, str(node))
    store.append(protocol.AGENTS_KEY, b"," + entry + b",")


def registered_nodes(store: dist.Store) -> list[int]:
    """Nodes with a validly sealed entry in the agents list."""
    raw = auth.read_raw(store, protocol.AGENTS_KEY)
    if raw is None:
        return []
    nodes = set()
    for token in bytes(raw).split(b","):
        payload = auth.open_value(protocol.AGENTS_KEY, token) if token else None
        if payload is not None:
            nodes.add(int(payload))
    return sorted(nodes)


def agent_info(store: dist.Store, node: int) -> dict | None:
    return protocol.read_json(store, protocol.agent_info_key(node))


@dataclass(frozen=True)
class OwnerRecord:
    node: int
    epoch: int  # 0 at launch, +1 with each takeover
    raw: bytes  # the sealed value as stored


#: group -> the newest owner record this process verified (one job per agent process).
_owners_seen: dict[int, OwnerRecord] = {}


def _parse_owner(group: int, raw: bytes | None) -> OwnerRecord | None:
    payload = auth.open_value(protocol.group_owner_key(group), raw)
    if payload is None or raw is None:
        return None
    rec = OwnerRecord(*protocol.parse_owner_payload(payload), bytes(raw))
    known = _owners_seen.get(group)
    if known is not None and rec.epoch < known.epoch:
        auth.report(protocol.group_owner_key(group), rec.raw,
                    f"an old owner record written back (epoch {rec.epoch} < {known.epoch})")
        return None
    _owners_seen[group] = rec
    return rec


def own_group(store: dist.Store, group: int, node: int) -> bool:
    """Claim group ``group`` at launch; False if some agent already owns it."""
    key = protocol.group_owner_key(group)
    _, payload = auth.claim(store, key, protocol.owner_payload(node, 0))
    owner_node, epoch = protocol.parse_owner_payload(payload)
    if owner_node != node:
        return False
    # Seals are deterministic: this is exactly the value in the store.
    sealed = signing.process_signer().seal(key, payload)
    _owners_seen[group] = OwnerRecord(node, epoch, sealed)
    return True


def take_over(store: dist.Store, group: int, lost: int, node: int) -> bool:
    """Move ``group`` from the lost node to this one; exactly one claimer wins.

    The compare-and-set goes from the exact stored value. If that value does not verify
    (a forger overwrote the lost owner's record), the record this agent verified before
    stands in for it, so a forger cannot block the takeover of a lost node's ranks.
    """
    key = protocol.group_owner_key(group)
    raw = auth.read_raw(store, key)
    rec = _parse_owner(group, raw)
    if rec is None:
        rec = _owners_seen.get(group)
    if rec is None or rec.node != lost:
        return False
    payload = protocol.owner_payload(node, rec.epoch + 1)
    if not auth.replace(store, key, raw or b"", payload):
        return False
    _parse_owner(group, signing.process_signer().seal(key, payload))
    return True


def reassert_owner(store: dist.Store, group: int, node: int) -> None:
    """Put this agent's owner record back if a forger replaced or deleted it."""
    known = _owners_seen.get(group)
    if known is None or known.node != node:
        return
    key = protocol.group_owner_key(group)
    raw = auth.read_raw(store, key)
    if raw is not None and bytes(raw) == known.raw:
        return
    current = _parse_owner(group, raw)
    if current is not None and current.epoch > known.epoch:
        return  # legitimately taken over by another agent
    store.compare_set(key, bytes(raw) if raw is not None else b"", known.raw)


def owner(store: dist.Store, group: int) -> int | None:
    """The node owning ``group``; None if none does or the record does not verify."""
    rec = _parse_owner(group, auth.read_raw(store, protocol.group_owner_key(group)))
    return None if rec is None else rec.node


def owners(store: dist.Store, ngroups: int) -> dict[int, int | None]:
    """group -> owning node (None while a group has no verified owner, e.g. before launch)."""
    keys = [protocol.group_owner_key(g) for g in range(ngroups)]
    present = [g for g, k in enumerate(keys) if store.check([k])]
    values = store.multi_get([keys[g] for g in present]) if present else []
    found = {g: _parse_owner(g, bytes(v)) for g, v in zip(present, values)}
    return {g: (rec.node if (rec := found.get(g)) is not None else None) for g in range(ngroups)}


def committed_step(store: dist.Store) -> int | str | None:
    """The newest committed step, for the agent's report ("unverified" if forged)."""
    try:
        step = _committed_step(store, protocol.COMMITTED_KEY)
    except UntrustedCommit:
        return "unverified"
    return None if step < 0 else step


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


#: A beat later than this many intervals (plus a second) is reported on the console.
HEARTBEAT_LATE_FACTOR = 2.0


class Heartbeat(threading.Thread):
    """Writes this agent's sealed heartbeat sequence number on its own connection.

    A separate client keeps beats flowing while the main loop waits on the store (a
    ``declare_failure`` can take a while), and avoids sharing one socket between threads.
    Each beat also puts back this agent's owner record and the generation records if a
    forger replaced them (:func:`reassert_owner`, ``protocol.reassert_generations``).
    """

    def __init__(self, host: str, port: int, node: int, interval_s: float,
                 group_of: Callable[[], int | None] = lambda: None) -> None:
        super().__init__(name=f"checkpointless-heartbeat-{node}", daemon=True)
        self._addr = (host, port)
        self._node = node
        self._key = protocol.agent_heartbeat_key(node)
        self._interval = interval_s
        self._group_of = group_of
        self._stop_event = threading.Event()

    def run(self) -> None:
        try:
            store = connect_store(*self._addr, timeout_s=OP_TIMEOUT_S)
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
                auth.put(store, self._key, str(seq))
                group = self._group_of()
                if group is not None:
                    reassert_owner(store, group, self._node)
                protocol.reassert_generations(store)
        except (StoreUnavailable, dist.DistError, RuntimeError):
            return  # the main loop notices a dead store on its own next operation

    def stop(self) -> None:
        """Stop beating; wait (briefly) for the thread to close its store connection."""
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=2.0)


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
        newly = []
        for n, key, raw in zip(nodes, keys, store.multi_get(keys)):
            payload = auth.open_value(key, raw)
            seq = int(payload) if payload is not None else None
            peer = self.peers.get(n)
            if peer is None:
                self.peers[n] = _Peer(-1 if seq is None else seq, now, gen)
            elif seq is not None and seq > peer.seq:
                peer.seq, peer.changed_at, peer.gen_alive = seq, now, gen
            elif now - peer.changed_at > self.timeout_s:
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
