"""A generation's rendezvous costs O(N) store operations in all, and every rank gets the
same plan: N threads, each a rank with its own client of a real TCPStore, run
``rendezvous.agree`` through a store wrapper that counts every request and every key it
names. Also: the planner's death, a forged counter, a forged plan, a late joiner and an
untrusted commit record, each on the same real store.

Run with ``-s`` to see the measured totals (the figures in ``recovery/generation/rendezvous.py``).
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest

from recovery.common.errors import Fenced, RecoveryImpossible
from recovery.generation import protocol
from recovery.generation import rendezvous as rdzv
from recovery.generation.protocol import JoinRecord
from recovery.generation.rendezvous import GenerationChanged, RecoveryPlan, agree
from recovery.job_store import auth
from replication.replica_protocol.commit import COMMITTED_KEY, UntrustedCommit, committed_step
from replication.side_channel import signing
from replication.side_channel.signing import Signer
from tests.helpers.mp import free_port, tcp_store

GEN = 1
STEP = 7


class CountingStore:
    """A store client that counts requests and the keys each names. Only the operations
    the rendezvous may use exist here, so an uncounted one fails loudly."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.requests: Counter[str] = Counter()
        self.keys = 0
        self.bulk: list[tuple[str, int]] = []  # requests that named more than one key

    def _count(self, op: str, nkeys: int) -> None:
        self.requests[op] += 1
        self.keys += nkeys
        if nkeys > 1:
            self.bulk.append((op, nkeys))

    def set(self, key: str, value: Any) -> None:
        self._count("set", 1)
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        self._count("get", 1)
        return self._store.get(key)

    def add(self, key: str, value: int) -> int:
        self._count("add", 1)
        return self._store.add(key, value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self._count("compare_set", 1)
        return self._store.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        self._count("check", len(keys))
        return self._store.check(keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._count("multi_get", len(keys))
        return self._store.multi_get(keys)

    def wait(self, keys: list[str], timeout: Any) -> None:
        self._count("wait", len(keys))
        self._store.wait(keys, timeout)

    @property
    def total_requests(self) -> int:
        return sum(self.requests.values())


@pytest.fixture
def master():
    signing.install(Signer(os.urandom(32)))
    auth._reported.clear()
    port = free_port()
    store = tcp_store(port, is_master=True, timeout_s=60)
    protocol.declare_failure(store, 0, {"kind": "worker_exit", "rank": 1, "ts": time.time()})
    auth.put(store, COMMITTED_KEY, str(STEP))
    yield store
    signing.install(None)
    auth._reported.clear()


def newcomers_of(n: int) -> set[int]:
    return {1, n // 2}


def per_node(n: int) -> int:
    return max(1, min(4, n // 2))


def record_of(rank: int, n: int) -> JoinRecord:
    """Rank ``rank`` of ``n`` (4 per node, fewer for small ``n``): a survivor holds steps
    6 and 7 of its own and a replica of the rank one node back (a ring across nodes); a
    newcomer holds nothing."""
    node = rank // per_node(n)
    if rank in newcomers_of(n):
        return JoinRecord(rank, node, 1000 + rank, True)
    return JoinRecord(rank, node, 1000 + rank, False, [6, 7],
                      {str((rank - per_node(n)) % n): [7]})


def expected_providers(n: int) -> dict[int, int]:
    return {k: (k + per_node(n)) % n for k in newcomers_of(n)}


@dataclass
class Rank:
    rank: int
    store: CountingStore
    result: tuple[RecoveryPlan, str | None] | None = None
    error: BaseException | None = None
    elapsed: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def _trusted_step(store: Any) -> int:
    """What the runtime's ``committed_step`` property does."""
    try:
        return committed_step(store)
    except UntrustedCommit as exc:
        raise RecoveryImpossible(f"cannot agree on a recovery target: {exc}") from None


def run_ranks(master: Any, ranks: list[int], n: int, *, takeover_s: float = rdzv.TAKEOVER_S,
              timeout_s: float = 60.0, gen: int = GEN,
              before: threading.Event | None = None,
              records: Any = record_of, late: dict[int, float] | None = None,
              join: Any = None, connect: Any = None, blocking: bool = False) -> list[Rank]:
    """Run ``agree`` for ``ranks`` of an ``n``-rank job, one thread and one store client
    each, all released together (rank ``r`` then sleeps ``late[r]`` seconds first);
    ``before`` set once every client is connected. ``join`` replaces ``agree`` (the
    measurement of the rendezvous this one replaced); ``connect()`` makes a client of
    another store than ``master``'s TCPStore."""
    people = [Rank(r, None) for r in ranks]  # type: ignore[arg-type]
    barrier = threading.Barrier(len(people) + 1)

    def one(p: Rank) -> None:
        # Connected here, in parallel: a TCPStore client now and then takes seconds to
        # connect on this host (a name lookup), and 64 in a row would add those up.
        cs = p.store = CountingStore(connect() if connect else tcp_store(
            master.port, is_master=False, timeout_s=60))
        node = p.rank // per_node(n)

        def fenced() -> str | None:  # what the runtime's _fenced reads
            owner = protocol.group_owner(cs, node)
            return None if owner is None or owner == node else f"node {node} fenced"

        barrier.wait()
        t0 = time.monotonic()
        time.sleep((late or {}).get(p.rank, 0.0))
        try:
            extra = {"blocking": True} if blocking else {}
            p.result = (join or agree)(cs, gen, records(p.rank, n), n, timeout_s,
                             lambda: protocol.current_generation(cs),
                             lambda: _trusted_step(cs), fenced, takeover_s=takeover_s,
                             **extra)
        except BaseException as exc:
            p.error = exc
        p.elapsed = time.monotonic() - t0

    threads = [threading.Thread(target=one, args=(p,), daemon=True) for p in people]
    for t in threads:
        t.start()
    barrier.wait()
    if before is not None:
        before.set()
    for t in threads:
        t.join(timeout_s + 30)
    assert not any(t.is_alive() for t in threads), "a rank never returned"
    return people


def agreed(people: list[Rank]) -> tuple[RecoveryPlan, str | None]:
    """The one (plan, impossible) every rank returned; fails if any rank erred or differs."""
    assert [(p.rank, p.error) for p in people if p.error] == []
    first = people[0].result
    assert first is not None
    assert all(p.result == first for p in people), [(p.rank, p.result) for p in people]
    return first


def wait_bound(elapsed: float) -> int:
    """The most keys a waiting rank may name in ``elapsed`` seconds, whatever N is: its
    record and the count (2), its polls of the plan, each followed by at most a
    generation check and a fencing check (3 per poll; polls are at least
    :data:`rdzv.FAST_POLL_S` apart and 50 ms apart after the first ~20), the final read
    of the plan, one repair check per second and a takeover counter read per interval."""
    polls = 20 + elapsed / rdzv.SLOW_POLL_S
    return int(2 + 3 * polls + 2 + 2 * (1 + elapsed / rdzv.REPAIR_CHECK_S)
               + (1 + elapsed / rdzv.TAKEOVER_S))


@pytest.mark.parametrize("late_s", [0.0, 0.5], ids=["together", "one-late"])
@pytest.mark.parametrize("n", [16, 64])
def test_rendezvous_cost_is_linear_and_every_rank_gets_the_same_plan(master, n, late_s):
    """All ranks at once, and one newcomer 0.5 s late (a warm spare taking over), so
    that everyone else polls while it comes."""
    # No takeover here (its own test below): on a starved host a planner thread can be
    # descheduled for seconds, and this test counts the path without one.
    people = run_ranks(master, list(range(n)), n, late={1: late_s}, takeover_s=60)
    plan, impossible = agreed(people)
    assert impossible is None
    assert plan == RecoveryPlan(GEN, STEP, expected_providers(n), plan.planner)

    # Only the planner names more than one key: one check and one multi_get of the
    # other N-1 records. Everyone else names one key per request.
    bulk = {p.rank: p.store.bulk for p in people if p.store.bulk}
    assert bulk == {plan.planner: [("check", n - 1), ("multi_get", n - 1)]}
    for p in people:
        own = p.store.keys - (2 * (n - 1) if p.rank == plan.planner else 0)
        assert own <= wait_bound(p.elapsed), (p.rank, p.store.requests, p.elapsed)
    keys = sum(p.store.keys for p in people)
    requests = sum(p.store.total_requests for p in people)
    assert keys <= sum(wait_bound(p.elapsed) for p in people) + 2 * n
    slowest = max(p.elapsed for p in people)
    print(f"\nN={n}: {requests} requests ({requests / n:.0f} per rank), {keys} keys "
          f"({keys / n:.0f} per rank), slowest rank {slowest:.2f}s, "
          f"ops {sum((p.store.requests for p in people), Counter())}")


def test_a_silent_planner_is_taken_over_by_at_most_max_takeovers(master):
    """Rank 3 joins last, so its count completes the join counter and it is the planner;
    it dies before it plans. The others take over within a few takeover intervals."""
    n, takeover_s = 4, 0.2
    joined = threading.Event()
    out: list[Rank] = []
    runner = threading.Thread(target=lambda: out.extend(run_ranks(
        master, [0, 1, 2], n, takeover_s=takeover_s, timeout_s=30, before=joined)))
    runner.start()
    joined.wait(30)
    deadline = time.monotonic() + 10
    while int(master.add(protocol.join_count_key(GEN), 0)) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    _, count = rdzv.publish_join(master, GEN, record_of(3, n))  # ... and dies
    assert count == n
    t0 = time.monotonic()
    runner.join(60)
    plan, impossible = agreed(out)
    assert impossible is None and plan.planner in (0, 1, 2)
    assert plan.target_step == STEP and plan.providers == expected_providers(n)
    planners = [p.rank for p in out if p.store.bulk]
    assert plan.planner in planners and len(planners) <= rdzv.MAX_TAKEOVERS
    assert time.monotonic() - t0 < 5 * takeover_s + 5


def test_a_forged_counter_and_a_forged_plan_change_nothing(master):
    """A forger bumps the counter so the first rank to join believes it completes it, and
    writes a plan of its own: the early planner waits for the real records, the waiters
    ignore the forged plan, the planner's compare-and-set replaces it."""
    n = 8
    rogue = tcp_store(master.port, is_master=False, timeout_s=30)
    rogue.add(protocol.join_count_key(GEN), n - 1)
    fake = Signer(os.urandom(32)).seal(protocol.plan_key(GEN), json.dumps(
        {"gen": GEN, "target_step": 0, "providers": {}, "impossible": None, "planner": 0}))
    rogue.set(protocol.plan_key(GEN), fake)
    rogue.check([protocol.plan_key(GEN)])  # landed
    people = run_ranks(master, list(range(n)), n)
    plan, impossible = agreed(people)
    assert (plan, impossible) == (RecoveryPlan(GEN, STEP, expected_providers(n),
                                               plan.planner), None)
    assert len([p for p in people if p.store.bulk]) >= 1
    assert protocol.plan_key(GEN) in {k for k, _ in auth._reported}


def test_a_late_rank_reads_the_plan_and_nothing_else(master):
    n = 4
    people = run_ranks(master, list(range(n)), n)
    plan = people[0].result
    [late] = run_ranks(master, [2], n)  # another process of rank 2, after the plan
    assert late.result == plan and not late.store.bulk
    assert late.store.keys <= 6, late.store.requests  # record, count, plan (check, get)


def test_an_untrusted_commit_record_is_one_verdict_for_all(master):
    n = 4
    master.set(COMMITTED_KEY, b"999")  # no seal
    people = run_ranks(master, list(range(n)), n)
    plan, impossible = agreed(people)
    assert plan.target_step == -1 and plan.providers == {}
    assert impossible is not None and "cannot agree on a recovery target" in impossible


def test_a_state_without_a_copy_is_one_verdict_for_all(master):
    n = 4
    people = run_ranks(master, list(range(n)), n,
                       records=lambda r, n: JoinRecord(r, r, 10 + r, True))  # nobody holds
    plan, impossible = agreed(people)
    assert plan.target_step == -1 and impossible is not None
    assert "has no surviving copy" in impossible
    assert rdzv.published_plan(master, GEN) == (plan, impossible)


@pytest.mark.parametrize("late_s", [0.0, 0.5], ids=["together", "one-late"])
def test_blocking_waiters_make_one_request_for_the_plan(master, late_s):
    """The runtime's way (``blocking=True``): a waiting rank blocks in the store on the
    plan key, so however long it waits, it names a handful of keys: its record, the
    count, the wait, the plan."""
    n = 32
    late = {n // 2: late_s} if late_s else {}
    people = run_ranks(master, list(range(n)), n, late=late, blocking=True)
    plan, impossible = agreed(people)
    assert impossible is None and plan.providers == expected_providers(n)
    waiters = [p for p in people if p.rank != plan.planner]
    worst = max(p.store.keys for p in waiters)
    assert worst <= 6, [(p.rank, p.store.keys) for p in waiters]


def test_a_declaration_wakes_ranks_blocked_on_the_plan(master):
    """A failure during the rendezvous: the declarer marks the superseded generation's
    plan, so blocked ranks leave at once with GenerationChanged (no poll ends it)."""
    n = 4
    woke: list[float] = []
    result: list[BaseException] = []

    def waiter(rank: int) -> None:
        cs = tcp_store(master.port, is_master=False, timeout_s=30)
        try:
            agree(cs, GEN, record_of(rank, n), n, 30, lambda: GEN, lambda: STEP,
                  blocking=True)
        except BaseException as exc:
            result.append(exc)
        woke.append(time.monotonic())

    threads = [threading.Thread(target=waiter, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # both joined and are blocked: ranks 2 and 3 never come
    declared = time.monotonic()
    protocol.declare_failure(master, GEN, {"kind": "worker_exit", "rank": 2,
                                           "ts": time.time()})
    for t in threads:
        t.join(10)
    assert len(result) == 2 and all(isinstance(e, GenerationChanged) for e in result), result
    assert all("superseded by" in str(e) for e in result)
    assert max(woke) - declared < 2.0, max(woke) - declared


def test_a_newer_generation_ends_the_wait(master):
    n = 3
    cs = CountingStore(tcp_store(master.port, is_master=False, timeout_s=30))
    gens = iter([GEN, GEN, GEN + 1])
    with pytest.raises(GenerationChanged, match="superseded by 2"):
        agree(cs, GEN, record_of(0, n), n, 30, lambda: next(gens, GEN + 1), lambda: STEP)


def test_the_same_rendezvous_over_etcd(master):
    """The production job store (ADR 0020) gives the same answer at the same cost shape:
    its ``add`` and ``compare_set`` are what the count and the plan rely on."""
    from tests.etcd_cluster import EtcdCluster, etcd_missing_reason

    if (why := etcd_missing_reason()) is not None:
        pytest.skip(why)
    from recovery.job_store.etcd_store import EtcdStore

    n = 16
    with EtcdCluster(1) as cluster:
        prefix = f"/test/{uuid.uuid4().hex}/"

        def connect() -> EtcdStore:
            return EtcdStore(cluster.endpoints, prefix, datetime.timedelta(seconds=10))

        setup = connect()
        protocol.declare_failure(setup, 0, {"kind": "worker_exit", "rank": 1, "ts": time.time()})
        auth.put(setup, COMMITTED_KEY, str(STEP))
        people = run_ranks(master, list(range(n)), n, connect=connect)
    plan, impossible = agreed(people)
    assert (plan, impossible) == (RecoveryPlan(GEN, STEP, expected_providers(n), plan.planner),
                                  None)
    assert {p.rank: p.store.bulk for p in people if p.store.bulk} == {
        plan.planner: [("check", n - 1), ("multi_get", n - 1)]}


def test_a_waiter_puts_its_clobbered_record_back(master):
    """Rank 0 waits (rank 1 has not joined); a forger overwrites its record, then deletes
    it: within about a second each time it is back, and rank 1's plan is made from it."""
    n = 2
    key = protocol.join_key(GEN, 0)
    rogue = tcp_store(master.port, is_master=False, timeout_s=30)
    out: list[Rank] = []
    waiter = threading.Thread(target=lambda: out.extend(run_ranks(master, [0], n)))
    waiter.start()
    deadline = time.monotonic() + 10
    while not master.check([key]):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    sealed = bytes(master.get(key))
    for clobber in (lambda: rogue.set(key, b"forged"), lambda: rogue.delete_key(key)):
        clobber()
        rogue.check([key])  # landed
        until = time.monotonic() + 3 * rdzv.REPAIR_CHECK_S
        while not (master.check([key]) and bytes(master.get(key)) == sealed):
            assert time.monotonic() < until, "rank 0 did not put its record back"
            time.sleep(0.05)
    [late] = run_ranks(master, [1], n)
    waiter.join(30)
    assert agreed([*out, late])[0] == RecoveryPlan(GEN, STEP, {1: 0}, planner=1)


def test_a_fenced_waiter_leaves(master):
    cs = tcp_store(master.port, is_master=False, timeout_s=30)
    calls = iter([None, None])
    with pytest.raises(Fenced, match="taken over"):
        agree(cs, GEN, record_of(0, 3), 3, 30, lambda: GEN, lambda: STEP,
              lambda: next(calls, "node 0 was taken over"))
