"""The job's c10d TCPStore: node 0's agent hosts it, every other agent (and worker) connects.

Agents coordinate only through this store (who is in the job and who runs which ranks:
:mod:`launcher.membership`; who is still alive: :mod:`launcher.liveness`). Every value
they write is sealed with the job key (:mod:`recovery.job_store.auth`): a process without the job
secret can write into the store, but no agent acts on what it writes. The store host
publishes a sealed key check, and a joining agent checks its key against it before it
writes anything (:func:`check_job_key`).

Connecting is the delicate part: node 0 may not be up yet, something else may listen
on the port, and a signal must still stop a waiting agent (:func:`connect_store`).

With ``--rdzv-backend c10d`` (the default) the store lives in node 0's agent, so losing
node 0 ends the job (as with torchrun's c10d backend); every agent then reports a lost
store instead of hanging. With ``--rdzv-backend etcd`` an etcd cluster holds the
records (:mod:`recovery.job_store.etcd_store`): no agent hosts anything, the first agent to
arrive publishes the key check, and any node may be lost.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from launcher import bind as bind_mod
from launcher import job_secret
from launcher.run_args import RunArgs
from recovery.generation import protocol
from recovery.job_store import store_address
from recovery.job_store.store_address import StoreAddress
from replication.errors import CheckpointlessError
from replication.side_channel import signing
from replication.side_channel.signing import Signer

#: Per-operation timeout once connected: long enough for a busy store, short enough
#: that an agent never waits forever on a stopped one.
OP_TIMEOUT_S = 30.0


class StoreUnavailable(CheckpointlessError, RuntimeError):
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

    store: dist.Store
    port: int
    signer: Signer
    plan: bind_mod.BindPlan
    address: StoreAddress  # what workers and this agent's other threads connect to
    shared_secret_file: str | None = None  # left for this machine's other agents

    def release(self) -> None:
        """Remove the secret file this agent left (the job is over)."""
        if self.shared_secret_file:
            with contextlib.suppress(OSError):
                os.unlink(self.shared_secret_file)


def open_job_store(args: RunArgs, run_dir: str, should_stop: Callable[[], bool],
                   say: Callable[[str], None] = lambda _m: None,
                   store_outage_s: float = store_address.DEFAULT_PATIENCE_S) -> JobStore:
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
    if args.uses_etcd:
        return _open_etcd(args, secret, plan, should_stop, say, store_outage_s)
    if args.hosts_store:
        if secret is None:
            secret = job_secret.generate()
            if bind_mod.is_local_only(args.host) and not args.standalone:  # others may join
                shared = job_secret.share_locally(run_dir, secret)
        signing.install(job_secret.signer_for(secret, args.rdzv_id))
        store = host_store(args.host, args.port, plan.address)
        return JobStore(store, store.port, signing.process_signer(), plan,
                        store_address.tcp(args.host, store.port), shared)
    store = connect_store(args.host, args.port, args.join_timeout_s, should_stop, say)
    if secret is None:
        try:
            secret = job_secret.read_shared(run_dir, should_stop=should_stop)
        except job_secret.SecretError as exc:
            raise StoreUnavailable(str(exc)) from None
    signing.install(job_secret.signer_for(secret, args.rdzv_id))
    check_job_key(store, f"{args.host}:{args.port}")
    return JobStore(store, args.port, signing.process_signer(), plan,
                    store_address.tcp(args.host, args.port))


def _open_etcd(args: RunArgs, secret: bytes | None, plan: bind_mod.BindPlan,
               should_stop: Callable[[], bool], say: Callable[[str], None],
               store_outage_s: float) -> JobStore:
    """Join the job's records in etcd: every agent alike (no host). The first to arrive
    publishes the sealed key check (a compare-and-set, so exactly one does); every
    agent then checks its key against it before it writes anything else."""
    assert secret is not None, "run_args.prepare requires a secret with etcd"
    signing.install(job_secret.signer_for(secret, args.rdzv_id))
    addr = store_address.etcd(list(args.etcd_endpoints), args.rdzv_id, store_outage_s)
    where = f"etcd {addr.endpoint_text()}"
    start = time.monotonic()
    deadline, next_report = start + args.join_timeout_s, start + WAIT_REPORT_S
    while True:
        try:
            store = store_address.connect(addr, OP_TIMEOUT_S)
            protocol.publish_keycheck_once(store)
            break
        except (CheckpointlessError, dist.DistError, RuntimeError, OSError) as exc:
            now = time.monotonic()
            if should_stop():
                raise StoreUnavailable("interrupted while waiting for the job store") from None
            if now > deadline:
                raise StoreUnavailable(f"cannot reach the job store at {where} within "
                                       f"{args.join_timeout_s:.0f}s ({brief(exc)})") from None
            if now >= next_report:
                say(f"waiting for the job store at {where}, {now - start:.0f}s of "
                    f"{args.join_timeout_s:.0f}s ({brief(exc)})")
                next_report = now + WAIT_REPORT_S
            time.sleep(0.5)
    check_job_key(store, where)
    refuse_a_finished_job(store, addr)
    return JobStore(store, 0, signing.process_signer(), plan, addr)


def _registered_but_none_alive(store: dist.Store, registered: Callable[[dist.Store], list[int]],
                               patience_s: float = 3.0) -> bool:
    """Agents joined this job, and none holds a live lease for ``patience_s`` (an agent
    registers a moment before its heartbeat thread first puts its lease record)."""
    deadline = time.monotonic() + patience_s
    while True:
        nodes = registered(store)
        if not nodes:
            return False
        keys = [protocol.agent_lease_key(n) for n in nodes]
        if any(v is not None for v in store.read_now(keys)):  # type: ignore[attr-defined]
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.2)


def refuse_a_finished_job(store: dist.Store, addr: StoreAddress) -> None:
    """Stop if the job's records in etcd belong to a job that is over.

    A TCPStore is born with its job; etcd keeps every record until someone deletes it,
    so a new job started with an old ``--rdzv-id`` would read the old job's generations
    and "done" records (it ended at once with "job done"). One that finished or failed
    left a sealed record saying so; one whose agents were all killed left agents but no
    live lease.
    """
    from launcher import membership

    why = None
    if protocol.any_done(store):
        why = "finished"
    elif protocol.fatal(store) is not None:
        why = "failed"
    elif _registered_but_none_alive(store, membership.registered_nodes):
        why = "was stopped (no agent of it is alive)"
    if why is not None:
        raise StoreUnavailable(
            f"job {addr.job!r} already ran on etcd {addr.endpoint_text()} and {why}: its "
            f"records are still under {addr.prefix!r}. Use a new --rdzv-id, or delete them "
            f"(etcdctl --endpoints {addr.endpoint_text()} del --prefix {addr.prefix})")


#: How often a joining agent says it is still waiting for the job store.
WAIT_REPORT_S = 5.0
#: How long a port that accepts connections may take to answer as a c10d store.
HANDSHAKE_S = 10.0


def connect_store(
    host: str, port: int, timeout_s: float, should_stop: Callable[[], bool] = lambda: False,
    say: Callable[[str], None] = lambda _m: None, capture_log: bool = True,
) -> dist.TCPStore:
    """Connect as a client, waiting up to ``timeout_s`` for node 0 to start its store.

    The wait probes the port with plain sockets first: that is quiet (c10d logs every
    failed attempt with a stack trace), says every few seconds what it waits for, and
    can be interrupted between probes by ``should_stop`` (a signal), where a blocking
    c10d connect could not. The c10d handshake then runs on a helper thread: something
    else listening on the port (another service, a stale process) can leave it blocked
    in a native receive that no signal interrupts; this thread gives up on it after
    :data:`HANDSHAKE_S` with a line naming the likely cause, or at once on a signal.

    ``capture_log=False``: leave fd 2 alone. The capture redirects the whole process's
    stderr, so only a connect made while no other thread writes may use it: the
    heartbeat thread's own connection, made while the agent's loop starts and prints
    its first lines, once swallowed them (the "joined job" line and a storage warning).
    """
    where = f"{host}:{port}"
    start = time.monotonic()
    deadline, next_report = start + timeout_s, start + WAIT_REPORT_S
    while not accepts(host, port):
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
    return _handshake(host, port, should_stop, capture_log)


def _handshake(host: str, port: int, should_stop: Callable[[], bool],
               capture_log: bool = True) -> dist.TCPStore:
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
    with _c10d_log_captured() if capture_log else _not_captured() as log_so_far:
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
def _not_captured():
    """What :func:`_c10d_log_captured` yields, with nothing captured."""
    yield lambda: ""


@contextlib.contextmanager
def _c10d_log_captured():
    """Send this process's stderr (fd 2) to a temporary file while c10d connects.

    c10d prints every retry of a failed handshake with a 25-frame C++ stack trace,
    straight to fd 2, for up to its whole timeout. Only the agent's first connect uses
    it (no worker and no other thread yet), so nothing else is hidden. Yields a function
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


def accepts(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Does something accept TCP connections at ``host:port`` within ``timeout_s``?

    The kernel completes the handshake for a listening socket, so a store host that is
    merely not scheduled still accepts; a host that is unreachable does not."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def brief(exc: BaseException) -> str:
    """The first line of a c10d error (the rest is a C++ stack trace)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]

