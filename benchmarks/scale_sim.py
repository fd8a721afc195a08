"""Drivers for the scale harness: the real protocol code, N simulated ranks as threads.

Two ways of timing, because this host has 2 cores and N=1024 threads share them:

* **Virtual time** for peer-to-peer agreement (:class:`VirtualNet`, used by the tree
  commit). Each simulated rank keeps a clock. A send stamps its message with the
  sender's clock, advanced by the CPU time its thread spent in protocol code since its
  last transport call (``time.thread_time``, which does not count time other threads
  held the GIL), plus a link latency; a receive sets the receiver's clock to the later
  of its own and the arrival. The latency of a step is the spread from the common start
  to the last rank's return: the critical path, as a cluster where every rank has its
  own cores would see it.
* **Wall clock against the real store** for store-bound protocols (the store count
  commit, liveness, rendezvous): the store is one server in a real job too, so N client
  threads on N connections drive it, and every request, key and byte is counted by
  :class:`CountingStore`.

Nothing here re-implements a protocol: the commit, the watch, the join and the plan are
the project's own functions, called as the runtime and the agent call them.
"""

from __future__ import annotations

import datetime
import json
import os
import queue
import resource
import socket
import statistics
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d's teardown warnings, x2048
# c10d looks up each connection's peer name; with this host's resolver a lookup that
# goes to DNS stalls a connect for 5 s now and then (2,048 connections took minutes).
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

import torch.distributed as dist

# --- counting ------------------------------------------------------------------------


class OpCounter:
    """Requests, keys and bytes per actor (a node id), thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_actor: dict[int, Counter] = defaultdict(Counter)

    def note(self, actor: int, op: str, keys: int, nbytes: int) -> None:
        with self._lock:
            c = self.by_actor[actor]
            c["requests"] += 1
            c["keys"] += keys
            c["bytes"] += nbytes
            c[f"op:{op}"] += 1

    def total(self, what: str) -> int:
        with self._lock:
            return sum(c[what] for c in self.by_actor.values())

    def max_actor(self, what: str) -> int:
        with self._lock:
            return max((c[what] for c in self.by_actor.values()), default=0)

    def ops(self) -> Counter:
        with self._lock:
            out: Counter = Counter()
            for c in self.by_actor.values():
                out.update({k[3:]: v for k, v in c.items() if k.startswith("op:")})
            return out

    def reset(self) -> None:
        with self._lock:
            self.by_actor.clear()


def _nbytes(v: Any) -> int:
    return len(v) if isinstance(v, (bytes, bytearray, str)) else 0


class CountingStore:
    """A store client that counts every request it makes (one request per call: a
    ``multi_get`` of k keys is one request of k keys, as on the wire of a TCPStore).

    ``clones`` supplies the connection :meth:`clone` returns (a pre-opened real client:
    opening 2,048 TCPStore connections one by one takes minutes here, see
    :class:`StorePool`); without it the inner store's own ``clone`` is used.
    """

    def __init__(self, inner: Any, counter: OpCounter, actor: int,
                 clones: Callable[[], Any] | None = None, prefix: str = "") -> None:
        self.inner, self.counter, self.actor = inner, counter, actor
        self._clones = clones
        self.prefix = prefix  # each experiment's own key space, as a job's would be

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _ks(self, keys: list[str]) -> list[str]:
        return [self._k(k) for k in keys]

    def _n(self, op: str, keys: int = 1, nbytes: int = 0) -> None:
        self.counter.note(self.actor, op, keys, nbytes)

    def set(self, key: str, value: bytes | str) -> None:
        self._n("set", 1, _nbytes(value))
        self.inner.set(self._k(key), value)

    def get(self, key: str) -> bytes:
        v = self.inner.get(self._k(key))
        self._n("get", 1, _nbytes(v))
        return v

    def add(self, key: str, amount: int) -> int:
        self._n("add")
        return self.inner.add(self._k(key), amount)

    def check(self, keys: list[str]) -> bool:
        self._n("check", len(keys))
        return self.inner.check(self._ks(keys))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        vs = self.inner.multi_get(self._ks(keys))
        self._n("multi_get", len(keys), sum(_nbytes(v) for v in vs))
        return vs

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._n("multi_set", len(keys), sum(_nbytes(v) for v in values))
        self.inner.multi_set(self._ks(keys), values)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._n("wait", len(keys))
        if timeout is None:
            self.inner.wait(self._ks(keys))
        else:
            self.inner.wait(self._ks(keys), timeout)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        v = self.inner.compare_set(self._k(key), expected, desired)
        self._n("compare_set", 1, _nbytes(desired) + _nbytes(v))
        return v

    def append(self, key: str, value: Any) -> None:
        self._n("append", 1, _nbytes(value))
        self.inner.append(self._k(key), value)

    def delete_key(self, key: str) -> bool:
        self._n("delete_key")
        return self.inner.delete_key(self._k(key))

    def num_keys(self) -> int:
        self._n("num_keys", 0)
        return self.inner.num_keys()

    def clone(self) -> CountingStore:
        inner = self._clones() if self._clones is not None else self.inner.clone()
        return CountingStore(inner, self.counter, self.actor, self._clones, self.prefix)

    def __getattr__(self, name: str) -> Any:
        """Backend extras (etcd's ``read_now``, leases): counted as one request each."""
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            keys = len(args[0]) if args and isinstance(args[0], list) else 1
            self._n(name, keys)
            return attr(*args, **kwargs)

        return call


# --- the store ------------------------------------------------------------------------


def raise_fd_limit() -> int:
    """N clients need 2N descriptors here (both ends live in this process)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class StorePool:
    """One real c10d TCPStore server (libuv, as the launcher's) and ``size`` client
    connections to it, opened in parallel (a connect now and then stalls for seconds
    on this host; in parallel the stalls overlap)."""

    def __init__(self, size: int, timeout_s: float = 120.0) -> None:
        raise_fd_limit()
        self.port = free_port()
        td = datetime.timedelta(seconds=timeout_s)
        self.server = dist.TCPStore("127.0.0.1", self.port, is_master=True,
                                    wait_for_workers=False, timeout=td)
        base = dist.TCPStore("127.0.0.1", self.port, is_master=False,
                             wait_for_workers=False, timeout=td)
        with ThreadPoolExecutor(64) as ex:
            self.conns = [base, *ex.map(lambda _: base.clone(), range(size - 1))]
        self._spare = iter(())  # see spare_clones
        self._lock = threading.Lock()

    def clients(self, n: int, counter: OpCounter, actor_of: Callable[[int], int],
                prefix: str, offset: int = 0) -> list[CountingStore]:
        """Counting clients on connections ``offset .. offset+n-1`` (rank r's actor is
        ``actor_of(r)``); their ``clone()`` hands out the connections after those."""
        spare = iter(self.conns[offset + n:])
        lock = threading.Lock()

        def next_conn() -> Any:
            with lock:
                return next(spare)

        return [CountingStore(self.conns[offset + r], counter, actor_of(r), next_conn, prefix)
                for r in range(n)]


# --- calibration ----------------------------------------------------------------------


def _gloo_pingpong(rank: int, port: int, iters: int) -> None:
    """One of two processes timing gloo send/recv of one int64; rank 0 prints JSON."""
    import torch

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=60))
    buf = torch.zeros(1, dtype=torch.int64)
    rtts, sends = [], []
    for i in range(iters):
        if rank == 0:
            t0 = time.perf_counter()
            dist.send(buf, 1)
            t1 = time.perf_counter()
            dist.recv(buf, 1)
            t2 = time.perf_counter()
            if i >= iters // 5:  # the first fifth warms the connection up
                rtts.append(t2 - t0)
                sends.append(t1 - t0)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)
    if rank == 0:
        # The quietest of 5 batches: other work on this shared host only adds time.
        k = max(1, len(rtts) // 5)
        batches = [(rtts[i:i + k], sends[i:i + k]) for i in range(0, 5 * k, k)]
        r, s = min(batches, key=lambda b: statistics.median(b[0]))
        print(json.dumps({"rtt_s": statistics.median(r), "send_s": statistics.median(s),
                          "rtt_p90_s": sorted(r)[int(0.9 * len(r))],
                          "rtt_all_median_s": statistics.median(rtts),
                          "samples": len(rtts)}), flush=True)
    dist.destroy_process_group()


def calibrate_link(iters: int = 2000) -> dict[str, float]:
    """Gloo's one-way latency of one int64 between two processes on loopback (round
    trip / 2) and the time a send call takes to return, measured now, in this run."""
    import subprocess
    import sys
    from pathlib import Path

    port = free_port()
    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.scale_sim", "pingpong",
                               str(r), str(port), str(iters)], cwd=repo, env=env,
                              stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        out, _ = procs[0].communicate(timeout=180)
        procs[1].wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    res = json.loads(out.strip().splitlines()[-1])
    res["link_s"] = res["rtt_s"] / 2
    return res


def calibrate_store(pool: StorePool, value_bytes: int, reps: int = 400) -> dict[str, float]:
    """Uncontended costs of one client on the real store: an ``add`` round trip (the
    service time the queue model charges per request), and the extra cost per key of a
    ``multi_get`` of values the size of a join record. Timed in 5 batches, keeping
    the quietest: what others run on this host can only add time."""
    c = pool.conns[0]
    for _ in range(50):
        c.add("calib/add", 1)
    batches = []  # the quietest of 5 batches: other work on the host only adds time
    for _ in range(5):
        ts = []
        for _ in range(reps // 5):
            t = time.perf_counter()
            c.add("calib/add", 1)
            ts.append(time.perf_counter() - t)
        batches.append(sorted(ts))
        time.sleep(0.05)
    ts = min(batches, key=statistics.median)
    keys = [f"calib/k{i}" for i in range(256)]
    c.multi_set(keys, [b"x" * value_bytes] * len(keys))
    one, many = [], []
    for _ in range(max(20, reps // 20)):
        t = time.perf_counter()
        c.multi_get(keys[:1])
        one.append(time.perf_counter() - t)
        t = time.perf_counter()
        c.multi_get(keys)
        many.append(time.perf_counter() - t)
    per_key = max(0.0, (statistics.median(many) - statistics.median(one)) / (len(keys) - 1))
    return {"request_s": statistics.median(ts), "request_p90_s": ts[int(0.9 * len(ts))],
            "per_key_s": per_key, "value_bytes": value_bytes}


def saturated_service_s(pool: StorePool, clients: int = 16, seconds: float = 1.0) -> float:
    """Seconds per request when ``clients`` threads keep the server busy (its
    throughput's inverse; on 2 shared cores the clients compete with the server)."""
    stop = time.monotonic() + seconds
    counts = [0] * clients

    def hammer(i: int) -> None:
        c = pool.conns[i]
        while time.monotonic() < stop:
            c.add(f"calib/sat{i}", 1)
            counts[i] += 1

    t = time.perf_counter()
    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return (time.perf_counter() - t) / max(1, sum(counts))


# --- the peer-to-peer transport in virtual time ----------------------------------------


class Abandoned(RuntimeError):
    """A receive waited past the harness's deadline (a protocol that hangs)."""


@dataclass
class VirtualNet:
    """In-memory transport for :class:`replication.replica_protocol.commit_tree.TreeCommit`.

    ``mode="virtual"``: clocks as described in the module docstring; a send costs its
    sender ``send_s`` (gloo's measured send call) and its message arrives ``link_s``
    after the send began. ``mode="wall"``: every message is really held back for
    ``link_s`` (the receiver sleeps until it is due), for checking the virtual clocks
    against real threads at small N.
    """

    world: int
    link_s: float
    send_s: float = 0.0
    mode: str = "virtual"
    timeout_s: float = 120.0
    clock: list[float] = field(init=False)
    mark: list[float] = field(init=False)
    sent: list[int] = field(init=False)
    cpu: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.clock = [0.0] * self.world
        self.mark = [0.0] * self.world
        self.sent = [0] * self.world
        self.cpu = [0.0] * self.world  # protocol CPU charged to each rank
        self._queues: dict[tuple[int, int, str], queue.SimpleQueue] = {}
        self._lock = threading.Lock()

    def _q(self, src: int, dst: int, kind: str) -> queue.SimpleQueue:
        key = (src, dst, kind)
        q = self._queues.get(key)
        if q is None:
            with self._lock:
                q = self._queues.setdefault(key, queue.SimpleQueue())
        return q

    def start(self, rank: int, t0: float) -> None:
        """On ``rank``'s thread: its clock reads ``t0`` now."""
        self.clock[rank] = t0
        self.mark[rank] = time.thread_time()

    def now(self, rank: int) -> float:
        """On ``rank``'s thread: its clock, with the CPU spent since the last call."""
        t = time.thread_time()
        dt = t - self.mark[rank]
        self.cpu[rank] += dt
        self.clock[rank] += dt
        self.mark[rank] = t
        return self.clock[rank]

    def charge(self, rank: int, seconds: float) -> None:
        """On ``rank``'s thread: it spent ``seconds`` outside protocol CPU (a store
        round trip), and nothing it did since the last mark counts."""
        self.clock[rank] += seconds
        self.mark[rank] = time.thread_time()

    def endpoint(self, rank: int) -> _Endpoint:
        return _Endpoint(self, rank)


class _Endpoint:
    def __init__(self, net: VirtualNet, rank: int) -> None:
        self.net, self.rank = net, rank

    def send(self, dst: int, kind: str, step: int) -> None:
        net, r = self.net, self.rank
        if net.mode == "virtual":
            began = net.now(r)
            arrival = began + net.link_s
            net.clock[r] = began + net.send_s
        else:
            arrival = time.monotonic() + net.link_s
        net.sent[r] += 1
        net._q(r, dst, kind).put((step, arrival))
        net.mark[r] = time.thread_time()  # the in-memory queue's own cost is not charged

    def recv(self, src: int, kind: str) -> int:
        net, r = self.net, self.rank
        if net.mode == "virtual":
            net.now(r)
        try:
            step, arrival = net._q(src, r, kind).get(timeout=net.timeout_s)
        except queue.Empty:
            raise Abandoned(f"rank {r}: nothing from rank {src} ({kind}) in "
                            f"{net.timeout_s:.0f}s") from None
        if net.mode == "virtual":
            net.clock[r] = max(net.clock[r], arrival)
        else:
            delay = arrival - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        net.mark[r] = time.thread_time()
        return step


def _run_threads(n: int, body: Callable[[int], None], stack_kib: int = 256) -> None:
    """Run ``body(rank)`` on n threads; re-raise the first error."""
    errors: list[BaseException] = []

    def wrap(r: int) -> None:
        try:
            body(r)
        except BaseException as exc:  # reported to the caller
            errors.append(exc)

    old = threading.stack_size(stack_kib * 1024)
    try:
        threads = [threading.Thread(target=wrap, args=(r,), daemon=True) for r in range(n)]
    finally:
        threading.stack_size(old)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


@dataclass
class TreeResult:
    latencies_s: list[float]  # per step
    messages_per_step: float
    store_requests_per_step: float
    store_requests_max_node_per_step: float
    cpu_per_rank_step_s: float  # protocol CPU charged per rank per step (mean)


def run_tree_commit(n: int, steps: int, link_s: float, send_s: float, record_s: float,
                    record: Callable[[int], None], counter: OpCounter,
                    mode: str = "virtual") -> TreeResult:
    """Every rank runs :meth:`TreeCommit.agree` for ``steps`` steps on its own thread.

    ``record`` is rank 0's real store write (it counts through ``counter``); in virtual
    time it is charged ``record_s``, its uncontended cost measured on its own.
    """
    from replication.replica_protocol.commit_tree import TreeCommit

    net = VirtualNet(n, link_s, send_s, mode)
    t0s = [10.0 * (i + 1) for i in range(steps)]  # virtual starts, far apart
    ends = [[0.0] * n for _ in range(steps)]
    wall_start = [0.0] * steps

    def rec(step: int) -> None:
        record(step)
        if mode == "virtual":
            net.charge(0, record_s)

    def release() -> None:
        wall_start[current[0]] = time.monotonic()

    current = [0]
    go, done = threading.Barrier(n, action=release), threading.Barrier(n)

    def body(r: int) -> None:
        tree = TreeCommit(r, n, net.endpoint(r), rec)
        for i in range(steps):
            if r == 0:
                current[0] = i
            go.wait()
            if mode == "virtual":
                net.start(r, t0s[i])
                tree.agree(i + 1)
                ends[i][r] = net.now(r)
            else:
                net.mark[r] = time.thread_time()
                tree.agree(i + 1)
                ends[i][r] = time.monotonic()
            assert tree.committed == i + 1
            done.wait()

    counter.reset()
    _run_threads(n, body)
    base = t0s if mode == "virtual" else wall_start
    lat = [max(ends[i]) - base[i] for i in range(steps)]
    return TreeResult(lat, sum(net.sent) / steps, counter.total("requests") / steps,
                      counter.max_actor("requests") / steps,
                      sum(net.cpu) / (n * steps) if mode == "virtual" else 0.0)


# --- the store-count commit (replication.commit=store) --------------------------------


@dataclass
class LedgerResult:
    latencies_s: list[float]
    requests_per_step: float
    requests_max_node_per_step: float
    ops_per_step: dict[str, float]


def run_ledger_commit(pool: StorePool, n: int, steps: int, ranks_per_node: int,
                      tag: str) -> LedgerResult:
    """N ranks ``ack`` then ``wait_committed`` each step on their own connections (and
    the clone each ledger opens for its waits), as ``Replicator._commit`` does; wall
    clock from the release of all ranks to the last one's return."""
    from replication.replica_protocol.commit import CommitLedger

    counter = OpCounter()
    clients = pool.clients(n, counter, lambda r: r // ranks_per_node, f"ledger-{tag}")
    ledgers = [CommitLedger(clients[r], n) for r in range(n)]  # the runtime's key names
    starts, ends = [0.0] * (steps + 1), [[0.0] * n for _ in range(steps + 1)]
    current = [0]

    def release() -> None:
        starts[current[0]] = time.monotonic()

    go, done = threading.Barrier(n, action=release), threading.Barrier(n)

    def body(r: int) -> None:
        for i in range(steps + 1):  # step 0 warms up (opens each ledger's wait client)
            if r == 0:
                current[0] = i
            go.wait()
            ledgers[r].ack(i)
            ledgers[r].wait_committed(i)
            ends[i][r] = time.monotonic()
            done.wait()
            if r == 0 and i == 0:
                counter.reset()
            done.wait()

    _run_threads(n, body)
    lat = [max(ends[i]) - starts[i] for i in range(1, steps + 1)]
    return LedgerResult(lat, counter.total("requests") / steps,
                        counter.max_actor("requests") / steps,
                        {k: v / steps for k, v in counter.ops().items()})


# --- liveness ---------------------------------------------------------------------------


@dataclass
class LivenessResult:
    nodes: int
    periods: int
    beat_requests_per_agent: float  # per period
    check_requests_per_agent: float
    check_keys_per_agent: float
    check_bytes_per_agent: float
    requests_per_agent_max: float
    check_wall_s: float  # median wall time of one agent's check, all agents at once
    lost: int  # nodes wrongly declared lost (must be 0)


@contextmanager
def _patched(module: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def run_liveness(pool: StorePool, nodes: int, periods: int, interval_s: float,
                 ranks_per_node: int, tag: str, offset: int = 0) -> LivenessResult:
    """``nodes`` agents: each registers and claims its group (launcher.membership), runs
    the real :class:`launcher.liveness.Heartbeat` thread and calls the real
    :meth:`PeerWatch.check` once per interval, as the agent's loop does."""
    from launcher import liveness, membership
    from recovery.job_store import store_address

    beat_counter, watch_counter = OpCounter(), OpCounter()
    connected: list[int] = []
    watch_clients = pool.clients(nodes, watch_counter, lambda r: r, f"live-{tag}", offset)
    beat_conns = iter(pool.conns[offset + nodes: offset + 2 * nodes])
    lock = threading.Lock()
    for node in range(nodes):
        membership.own_group(watch_clients[node], node, node)
        membership.register(watch_clients[node], node, ranks_per_node, spare=False)
    watch_counter.reset()

    def connect(host: str, port: int, timeout_s: float = 0.0, **_kw: Any) -> CountingStore:
        with lock:
            connected.append(port)
            return CountingStore(next(beat_conns), beat_counter, len(connected) - 1,
                                 prefix=f"live-{tag}")

    addr = store_address.tcp("127.0.0.1", pool.port)
    watches = [liveness.PeerWatch(n, timeout_s=3600.0) for n in range(nodes)]
    walls: list[float] = []
    per = [0.0] * nodes
    lost = 0
    with _patched(liveness, "connect_store", connect):
        beats = [liveness.Heartbeat(addr, n, interval_s, group_of=lambda n=n: n)
                 for n in range(nodes)]
        for b in beats:
            b.start()
        for p in range(periods + 1):
            if p == 1:
                watch_counter.reset()  # the first check only meets the peers
            t_next = time.monotonic() + interval_s

            def one(n: int) -> None:
                t = time.perf_counter()
                got = watches[n].check(watch_clients[n], 0)
                per[n] = time.perf_counter() - t
                if got:
                    raise AssertionError(f"node {n} declared {got} lost in a healthy job")

            try:
                _run_threads(nodes, one)
            except AssertionError:
                lost += 1
            if p >= 1:
                walls.append(statistics.median(per))
            time.sleep(max(0.0, t_next - time.monotonic()))
        for b in beats:
            b.stop()
    sets = sum(c["op:set"] for c in beat_counter.by_actor.values())
    beat_reqs = beat_counter.total("requests")
    n_beats = max(1, sets)  # one sealed heartbeat set per beat
    checks = periods * nodes
    return LivenessResult(
        nodes, periods, beat_reqs / n_beats, watch_counter.total("requests") / checks,
        watch_counter.total("keys") / checks, watch_counter.total("bytes") / checks,
        watch_counter.max_actor("requests") / periods + beat_reqs / n_beats,
        statistics.median(walls), lost)


# --- rendezvous and recovery plan -------------------------------------------------------


def plan_planner(store: Any, gen: int, record: Any, world: int, fenced: Callable[[], Any],
                 ) -> Any:
    """The planner-based rendezvous (ADR 0024): ``agree`` returns the plan one planner
    computed. ``current_gen`` is what the runtime passes: its watchdog's view of the
    generation, which costs no store request (the watchdog blocks on the next cause
    record on a connection of its own); in this harness nothing declares a newer one."""
    from recovery.generation import rendezvous
    from replication.replica_protocol.commit import committed_step

    plan, impossible = rendezvous.agree(  # type: ignore[attr-defined]
        store, gen, record, world, 120.0, lambda: gen,
        lambda: committed_step(store), fenced, blocking=True)
    if impossible is not None:
        raise RuntimeError(impossible)
    return plan


def rendezvous_impl() -> tuple[str, Callable[..., Any]]:
    """The rendezvous the runtime uses (the planner's, ADR 0024). The first version's
    (every rank polling all N join keys, then ``make_plan`` on every rank) is gone from
    the code; its measured figures stay in ``docs/scale.md`` and ADR 0024."""
    return "planner", plan_planner


class _GatedStore(CountingStore):
    """A rank's client that, once the rank has published its join record, holds it
    until every rank has: the ranks of a real job publish within milliseconds of one
    another, while 1,024 threads on 2 cores take seconds to, and the early ones' polls
    (every 5 ms, each of N keys with today's join) then multiply both the polls and
    the time. The harness's start line, not the protocol's."""

    def __init__(self, inner: CountingStore, own_key: str, gate: threading.Barrier) -> None:
        super().__init__(inner.inner, inner.counter, inner.actor, inner._clones, inner.prefix)
        self._own_key, self._gate, self._passed = own_key, gate, False

    def set(self, key: str, value: bytes | str) -> None:
        super().set(key, value)
        if key == self._own_key and not self._passed:
            self._passed = True
            self._gate.wait()


@dataclass
class RendezvousResult:
    n: int
    impl: str
    wall_s: float
    requests: int
    keys: int
    bytes: int
    requests_max_node: int
    cpu_max_rank_s: float  # protocol CPU of the busiest rank (its thread_time)
    cpu_median_rank_s: float
    newcomers: int
    providers_ok: bool


def run_rendezvous(pool: StorePool, n: int, ranks_per_node: int, factor: int,
                   lost_node: int, gen: int, tag: str) -> RendezvousResult:
    """One recovery after the loss of ``lost_node``: its ranks rejoin as newcomers with
    nothing, every survivor brings its own snapshot of the committed step and the
    replicas its placement gives it; all N ranks rendezvous at once on their own
    connections and each derives the plan."""
    from launcher import membership
    from recovery.common.causes import FailureCause
    from recovery.generation import protocol
    from recovery.job_store import auth
    from replication.replica_protocol.commit import COMMITTED_KEY
    from replication.replica_protocol.placement import place_replicas, sources_of
    from replication.side_channel import signing

    name, impl = rendezvous_impl()
    counter = OpCounter()
    clients = pool.clients(n, counter, lambda r: r // ranks_per_node, f"rdzv-{tag}")
    node_of = [r // ranks_per_node for r in range(n)]
    sources = sources_of(place_replicas(node_of, factor, "ring"))
    target = 7
    setup = clients[0]
    setup.set(COMMITTED_KEY, signing.seal(COMMITTED_KEY, str(target)))
    for g in range(1, gen + 1):
        key = protocol.cause_key(g)
        if not setup.check([key]):
            auth.put(setup, key, json.dumps({"kind": FailureCause.NODE_LOST, "node": lost_node}))
    for group in range(n // ranks_per_node):
        membership.own_group(setup, group, group)
    counter.reset()
    records = []
    for r in range(n):
        newcomer = node_of[r] == lost_node
        records.append(protocol.JoinRecord(
            rank=r, node=node_of[r], pid=100000 + r, newcomer=newcomer,
            local_steps=[] if newcomer else [target - 1, target],
            replicas={} if newcomer else {str(s): [target - 1, target] for s in sources[r]}))
    plans: list[Any] = [None] * n
    cpu = [0.0] * n
    starts = [0.0]
    ends = [0.0] * n
    barrier = threading.Barrier(n, action=lambda: starts.__setitem__(0, time.monotonic()))
    gate = threading.Barrier(n)

    def body(r: int) -> None:
        store = _GatedStore(clients[r], protocol.join_key(gen, r), gate)
        group = r // ranks_per_node

        def fenced() -> str | None:
            owner = protocol.group_owner(store, group)
            return None if owner is None or owner == node_of[r] else "fenced"

        barrier.wait()
        c0 = time.thread_time()
        plans[r] = impl(store, gen, records[r], n, fenced)
        cpu[r] = time.thread_time() - c0
        ends[r] = time.monotonic()

    _run_threads(n, body)
    first = plans[0]
    same = all(p.providers == first.providers and p.target_step == target for p in plans)
    lost = {r for r in range(n) if node_of[r] == lost_node}
    ok = same and set(first.providers) == lost and all(
        node_of[p] != lost_node for p in first.providers.values())
    return RendezvousResult(
        n, name, max(ends) - starts[0], counter.total("requests"), counter.total("keys"),
        counter.total("bytes"), counter.max_actor("requests"), max(cpu),
        statistics.median(cpu), len(lost), ok)


def join_record_bytes(n: int, ranks_per_node: int, factor: int) -> int:
    """Size of one sealed join record, as :func:`run_rendezvous` writes them."""
    from recovery.generation import protocol
    from replication.side_channel import signing

    rec = protocol.JoinRecord(rank=n - 1, node=(n - 1) // ranks_per_node, pid=100000,
                              newcomer=False, local_steps=[6, 7],
                              replicas={str(n - 2): [6, 7]} if factor > 1 else {})
    return len(signing.process_signer().seal("cl/g1/join/1", rec.to_json()))


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["pingpong"]:
        _gloo_pingpong(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
