"""The job store on etcd: c10d semantics on real etcd members, no mocks.

Every test talks to real ``etcd`` processes on loopback (``tests/etcd_cluster.py``).
Without ``/usr/bin/etcd`` the file is skipped, unless ``TESTS_REQUIRE_ETCD=1`` (CI),
where a missing etcd fails instead.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
import uuid

import pytest
import torch.distributed as dist

from recovery.generation import protocol
from recovery.job_store import auth
from recovery.job_store.etcd_store import (
    EtcdLeaseExpired,
    EtcdStore,
    EtcdStoreTimeout,
    EtcdUnavailable,
)
from replication.errors import CheckpointlessError
from replication.replica_protocol.commit import CommitLedger
from replication.side_channel import signing
from replication.side_channel.signing import Signer
from tests.etcd_cluster import EtcdCluster, etcd_missing_reason
from tests.helpers.mp import free_port, run_workers

_missing = etcd_missing_reason()
if _missing is not None:
    if os.environ.get("TESTS_REQUIRE_ETCD") == "1":
        pytest.fail(f"{_missing}, and TESTS_REQUIRE_ETCD=1", pytrace=False)
    pytest.skip(_missing, allow_module_level=True)

SECOND = datetime.timedelta(seconds=1)


@pytest.fixture(scope="module")
def cluster():
    with EtcdCluster(1) as c:
        yield c


@pytest.fixture
def store(cluster) -> EtcdStore:
    return EtcdStore(cluster.endpoints, f"/test/{uuid.uuid4().hex}/", 5 * SECOND)


def test_set_get_check_delete_num_keys(store):
    assert store.num_keys() == 0 and not store.check(["a"])
    store.set("a", b"1")
    store.set("b", "two")  # str values are encoded, as TCPStore does
    store.set("empty", b"")
    assert store.get("a") == b"1" and store.get("b") == b"two" and store.get("empty") == b""
    assert store.check(["a", "b", "empty"]) and not store.check(["a", "nope"])
    assert store.multi_get(["b", "a"]) == [b"two", b"1"]
    store.multi_set(["c", "d"], [b"3", b"4"])
    assert store.num_keys() == 5
    assert store.delete_key("a") is True and store.delete_key("a") is False
    assert not store.check(["a"]) and store.num_keys() == 4
    store.append("log", b"x")
    store.append("log", b"y")
    assert store.get("log") == b"xy"


def test_a_blocking_get_times_out_naming_the_key_and_timeout(store):
    store.set_timeout(datetime.timedelta(milliseconds=300))
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match=r"300ms.*/never'") as info:
        store.get("never")
    assert 0.29 < time.monotonic() - t0 < 2.0
    assert isinstance(info.value, (CheckpointlessError, EtcdStoreTimeout))
    with pytest.raises(dist.DistStoreError, match="200ms"):
        store.wait(["never"], datetime.timedelta(milliseconds=200))


def test_a_blocking_wait_wakes_on_the_write(store):
    def later() -> None:
        time.sleep(0.3)
        store.clone().set("late", b"v")

    threading.Thread(target=later).start()
    t0 = time.monotonic()
    assert store.get("late") == b"v"
    woke = time.monotonic() - t0
    assert 0.29 < woke < 0.6, woke  # the watch, not a slow poll, woke it


def test_add_is_atomic_across_threads(store):
    seen: list[int] = []

    def worker() -> None:
        own = store.clone()
        seen.extend(own.add("n", 1) for _ in range(25))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen) == list(range(1, 101))
    assert store.get("n") == b"100" and store.add("n", 0) == 100 and store.add("n", -5) == 95


def test_compare_set_has_c10d_semantics(store):
    assert store.compare_set("k", b"old", b"new") == b"old"  # absent, expected not empty
    assert not store.check(["k"])
    assert store.compare_set("k", b"", b"first") == b"first"  # absent, expected empty
    assert store.compare_set("k", b"", b"again") == b"first"  # present, mismatch
    assert store.compare_set("k", b"first", b"second") == b"second"
    assert store.get("k") == b"second"


def test_prefixes_isolate_jobs(cluster):
    a = EtcdStore(cluster.endpoints, "/jobs/a/", SECOND)
    b = EtcdStore(cluster.endpoints, "/jobs/ab/", SECOND)  # a's prefix is a prefix of b's
    a.set("x", b"a")
    b.set("x", b"b")
    assert (a.get("x"), b.get("x"), a.num_keys(), b.num_keys()) == (b"a", b"b", 1, 1)


def test_leases_expire_and_revoke(store):
    lease = store.grant_lease(5)
    store.set_with_lease("alive", b"1", lease)
    assert store.keepalive(lease) >= 4
    assert store.revoke(lease) is True
    assert not store.check(["alive"])
    short = store.grant_lease(1)
    store.set_with_lease("brief", b"1", short)
    deadline = time.monotonic() + 5  # TTL 1 s, expiry checked every 0.5 s
    while store.check(["brief"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not store.check(["brief"])
    with pytest.raises(EtcdLeaseExpired):
        store.keepalive(short)


def test_add_from_two_processes(cluster, tmp_path):
    prefix = f"/test/{uuid.uuid4().hex}/"
    run = run_workers("tests.workers.etcd_worker", 2, {
        "mode": "add", "adds": 30, "endpoints": cluster.endpoints, "prefix": prefix},
        tmp_path, timeout_s=40)
    assert not run.timed_out and set(run.returncodes.values()) == {0}, run.describe()
    seen = sorted(run.results[0]["seen"] + run.results[1]["seen"])
    assert seen == list(range(1, 61))


def test_a_gloo_group_rendezvous_over_etcd(cluster, tmp_path):
    """Two processes connect a gloo group through an EtcdStore and all-reduce. The limit
    only catches a hang (the group's own 30 s timeout raises first): beside a steady
    load with a disk writer, two ranks were killed at the earlier 40 s limit with nothing
    logged, so each rank now logs how far it got."""
    prefix = f"/test/{uuid.uuid4().hex}/"
    run = run_workers("tests.workers.etcd_worker", 2, {
        "mode": "gloo", "endpoints": cluster.endpoints, "prefix": prefix}, tmp_path,
        timeout_s=150)
    assert not run.timed_out and set(run.returncodes.values()) == {0}, run.describe()
    assert [run.results[r]["sum"] for r in (0, 1)] == [3.0, 3.0]


def test_the_control_plane_runs_unchanged(store):
    """Sealed records, generations and the commit ledger work on an EtcdStore."""
    signing.install(Signer(os.urandom(32)))
    try:
        assert protocol.current_generation(store) == 0
        assert protocol.declare_failure(store, 0, {"kind": "exception", "rank": 1}) == 1
        assert protocol.declare_failure(store, 0, {"kind": "exception", "rank": 1}) == 1
        assert (protocol.current_generation(store), protocol.failures(store)) == (1, 1)
        protocol.reassert_generations(store)
        assert auth.claim(store, "cl/owner", "me") == (True, "me")
        assert auth.claim(store, "cl/owner", "you") == (False, "me")
        ledgers = [CommitLedger(store.clone(), 2, timeout_s=5) for _ in range(2)]
        done = threading.Thread(target=ledgers[0].wait_committed, args=(7,))
        done.start()
        assert ledgers[0].ack(7) is False and ledgers[1].ack(7) is True
        done.join(5)
        assert not done.is_alive() and ledgers[0].committed_step() == 7
        ledgers[0].forget(7)
    finally:
        signing.install(None)


def test_failover_when_a_member_dies():
    """The leader dies while a client talks to it and another waits on it: both go on
    with the other two members (after their election) within a few seconds."""
    with EtcdCluster(3) as cluster:
        lead = cluster.leader()
        order = [cluster.endpoints[lead]] + [e for i, e in enumerate(cluster.endpoints)
                                             if i != lead]
        store = EtcdStore(order, "/job/", 5 * SECOND, request_timeout=2.0)
        store.set("before", b"1")
        assert store.add("n", 1) == 1
        waiter, got = store.clone(), []
        blocked = threading.Thread(target=lambda: got.append(waiter.get("after")))
        blocked.start()  # watching on member 0 when it dies
        time.sleep(0.2)
        cluster.stop(lead)  # the member both clients talk to first
        t0 = time.monotonic()
        assert store.get("before") == b"1"
        assert store.add("n", 1) == 2
        store.set("after", b"2")
        assert time.monotonic() - t0 < 5
        blocked.join(5)
        assert got == [b"2"]
        cluster.start(lead)
        cluster.stop((lead + 1) % 3)  # a different majority: the restarted one caught up
        assert EtcdStore(cluster.endpoints, "/job/", SECOND).get("after") == b"2"


def test_every_member_down_is_a_clear_bounded_error():
    dead = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    store = EtcdStore(dead, "/job/", SECOND, request_timeout=0.5, unavailable_after=1.0)
    t0 = time.monotonic()
    with pytest.raises(EtcdUnavailable) as info:
        store.set("k", b"v")
    assert time.monotonic() - t0 < 3
    assert all(e in str(info.value) for e in dead)
    assert isinstance(info.value, dist.DistStoreError)
