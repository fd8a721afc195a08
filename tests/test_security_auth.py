"""The sealed control plane, piece by piece, on a real TCPStore with several clients.

Each test plays a legitimate participant (this process's job key) against a forger: a
second client of the same store that writes raw values, or values sealed with another
key. Nothing a forger writes may change what the participant decides, a forged value
in a first-writer-wins slot must not lock the legitimate writer out, and every forged
value read is reported.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from launcher import job_outcome, job_store, liveness, membership
from recovery.common.errors import RecoveryImpossible
from recovery.generation import protocol
from recovery.generation.rendezvous import RecoveryPlan, agree, publish_join, published_plan
from recovery.job_store import auth
from replication import contract
from replication.replica_protocol.commit import CommitLedger, UntrustedCommit, committed_step
from replication.side_channel import signing
from replication.side_channel.signing import Signer, derive_job_key
from tests.helpers.mp import free_port, tcp_store


@pytest.fixture
def rejected():
    """Installs a fresh job key and collects what gets reported; restores both after."""
    found: list[dict] = []
    signing.install(Signer(os.urandom(32)))
    auth.set_reporter(lambda **f: found.append(f))
    auth._reported.clear()
    membership._owners_seen.clear()
    yield found
    auth.set_reporter(None)
    auth._reported.clear()
    membership._owners_seen.clear()
    signing.install(None)


class _Landed:
    """A store client whose ``set`` has landed when it returns.

    c10d's SET gets no reply, so a write on one socket may reach the server after an
    operation sent later on another socket (seen under load: a forger's value arriving
    after our compare-and-set; on CI, the store host's key check not yet visible to
    another client). A round trip on the same socket orders them.
    """

    def __init__(self, store) -> None:
        self._store = store

    def set(self, key, value) -> None:
        self._store.set(key, value)
        self._store.check([key])

    def __getattr__(self, name):
        return getattr(self._store, name)


@pytest.fixture
def stores():
    """The store server, and two more clients: one for us, one for the forger."""
    port = free_port()
    master = _Landed(tcp_store(port, is_master=True, timeout_s=30))
    return master, tcp_store(port, is_master=False, timeout_s=30), _Landed(tcp_store(
        port, is_master=False, timeout_s=30))


def forged(key: str, payload: str) -> bytes:
    """A value sealed with some other key (a forger running our code with its own secret)."""
    return Signer(os.urandom(32)).seal(key, payload)


def keys_of(found: list[dict]) -> set[str]:
    return {f["key"] for f in found}


# --- seals ------------------------------------------------------------------------------
def test_seal_round_trip_and_every_kind_of_tampering():
    s = Signer(b"k" * 32)
    raw = s.seal("cl/fatal", '{"reason": "x"}')
    assert s.open("cl/fatal", raw) == b'{"reason": "x"}'
    assert s.open("cl/fatal", raw.decode()) == b'{"reason": "x"}'
    assert s.open("cl/other", raw) is None  # a seal is valid under its own key name only
    assert Signer(b"j" * 32).open("cl/fatal", raw) is None  # another job key
    tampered = raw[:-2] + b"y}"
    assert s.open("cl/fatal", tampered) is None
    for junk in (b"", b"cl1:", b"1", b'{"reason": "x"}', raw[:60], b"cl1:" + b"0" * 64 + b"x"):
        assert s.open("cl/fatal", junk) is None
    assert "key" not in repr(s).lower() or "authenticated" in repr(s)
    assert s.key_hex() not in repr(s)


def test_job_key_depends_on_secret_and_job_id():
    a = derive_job_key(b"secret-one-0123456789", "job1")
    assert a == derive_job_key(b"secret-one-0123456789", "job1")
    assert a != derive_job_key(b"secret-one-0123456789", "job2")
    assert a != derive_job_key(b"secret-two-0123456789", "job1")


def test_without_a_job_key_a_process_is_unauthenticated(monkeypatch):
    monkeypatch.delenv(contract.ENV_JOB_KEY, raising=False)
    signing.install(None)
    try:
        assert signing.process_signer().authenticated is False
        monkeypatch.setenv(contract.ENV_JOB_KEY, os.urandom(32).hex())
        signing.install(None)
        assert signing.process_signer().authenticated is True
    finally:
        signing.install(None)


# --- generations ------------------------------------------------------------------------
def test_forged_cause_and_counters_do_not_move_the_generation(rejected, stores):
    _, ours, rogue = stores
    assert protocol.current_generation(ours) == 0
    rogue.set(protocol.cause_key(1), json.dumps({"kind": "worker_exit", "rank": 0}))
    rogue.set("cl/gen", "5")
    rogue.add("cl/recoveries", 99)
    assert protocol.current_generation(ours) == 0
    assert protocol.recoveries(ours) == 0
    rogue.set(protocol.cause_key(1), forged(protocol.cause_key(1), "{}"))
    assert protocol.current_generation(ours) == 0
    assert protocol.cause_key(1) in keys_of(rejected)


def test_declaring_replaces_a_forged_cause_and_dedupes(rejected, stores):
    master, ours, rogue = stores
    rogue.set(protocol.cause_key(1), b"forged before any failure")
    assert protocol.declare_failure(ours, 0, {"kind": "a"}, timeout_s=5) == 1
    # a second detector of the same failure (observed gen 0) dedupes: still one generation
    assert protocol.declare_failure(master, 0, {"kind": "b"}, timeout_s=5) == 1
    assert protocol.read_json(master, protocol.cause_key(1))["kind"] == "a"
    assert protocol.recoveries(master) == 1


def test_a_clobbered_generation_record_is_put_back(rejected, stores):
    master, ours, rogue = stores
    protocol.declare_failure(ours, 0, {"kind": "a"}, timeout_s=5)
    protocol.declare_failure(ours, 1, {"kind": "b"}, timeout_s=5)
    assert protocol.current_generation(ours) == 2
    rogue.set(protocol.cause_key(1), b"clobbered")
    rogue.delete_key(protocol.cause_key(2))
    protocol.reassert_generations(ours)  # what the agent's heartbeat thread does
    fresh = tcp_store(master.port, is_master=False, timeout_s=30)  # a replacement's walk
    assert protocol.current_generation(fresh) == 2


def test_persistent_forger_makes_declare_give_up_not_hang(rejected, stores, monkeypatch):
    _, ours, rogue = stores

    class Racing:  # every compare-and-set meets a freshly forged value
        def __getattr__(self, name):
            return getattr(ours, name)

        def compare_set(self, key, expected, desired):
            rogue.set(key, os.urandom(8))
            return ours.compare_set(key, expected, desired)

    monkeypatch.setattr(auth, "CLAIM_ATTEMPTS", 5)
    with pytest.raises(auth.StoreTampered, match="keeps being replaced"):
        auth.claim(Racing(), protocol.cause_key(1), "{}")


# --- fatal ------------------------------------------------------------------------------
def test_forged_fatal_is_ignored_and_a_real_one_still_lands(rejected, stores):
    master, ours, rogue = stores
    rogue.set(protocol.FATAL_KEY, json.dumps({"reason": "rogue says stop"}))
    assert protocol.fatal(ours) is None
    protocol.set_fatal(ours, "real reason")
    assert protocol.fatal(master)["reason"] == "real reason"
    rogue.set(protocol.FATAL_KEY, forged(protocol.FATAL_KEY, '{"reason": "x"}'))
    assert protocol.fatal(master) is None
    assert protocol.FATAL_KEY in keys_of(rejected)


# --- group owners -----------------------------------------------------------------------
def test_owner_claims_and_takeovers_ignore_forgeries(rejected, stores):
    master, ours, rogue = stores
    key = protocol.group_owner_key(0)
    rogue.compare_set(key, "", "7")  # the forger is first
    assert membership.own_group(ours, 0, 0)  # replaced: the legitimate claim wins
    assert membership.owner(master, 0) == 0
    assert not membership.own_group(master, 0, 3)  # a second legitimate claimer loses
    rogue.set(key, json.dumps({"node": 9, "epoch": 4}))
    assert membership.owner(master, 0) is None  # not trusted
    assert membership.owners(master, 2) == {0: None, 1: None}
    # node 0 is lost: with the record forged, the verified one stands in; one claimer wins
    wins = [membership.take_over(c, 0, lost=0, node=n) for c, n in ((ours, 2), (master, 3))]
    assert wins == [True, False]
    assert membership.owner(master, 0) == 2
    assert not membership.take_over(master, 0, lost=0, node=3)  # 0 no longer owns it


def test_an_old_owner_record_written_back_is_refused_and_repaired(rejected, stores):
    master, ours, rogue = stores
    key = protocol.group_owner_key(0)
    assert membership.own_group(ours, 0, 0)
    old = bytes(master.get(key))
    assert membership.take_over(ours, 0, lost=0, node=2)
    rogue.set(key, old)  # a replay of a genuine, older record
    assert membership.owner(ours, 0) is None
    assert any("old owner record" in f["reason"] for f in rejected)
    membership.reassert_owner(ours, 0, 2)  # the owner's heartbeat thread puts its record back
    assert membership.owner(ours, 0) == 2


def test_forged_agents_and_heartbeats_are_no_sign_of_life(rejected, stores):
    master, ours, rogue = stores
    membership.register(ours, 1, nproc=2, spare=False)
    rogue.append(protocol.AGENTS_KEY, "5,garbage")  # an unterminated forged entry
    membership.register(ours, 2, nproc=2, spare=False)  # and a legitimate one after it
    rogue.append(protocol.AGENTS_KEY, b"," + forged(protocol.AGENTS_KEY, "6") + b",")
    assert membership.registered_nodes(master) == [1, 2]
    watch = liveness.PeerWatch(node=0, timeout_s=0.3)
    assert watch.check(master, 0) == []
    hb = protocol.agent_heartbeat_key(1)
    end = time.monotonic() + 0.6
    while time.monotonic() < end:  # node 1 is dead; the forger keeps "beating" for it
        rogue.set(hb, forged(hb, str(int(time.monotonic() * 1000))))
        auth.put(ours, protocol.agent_heartbeat_key(2), str(int(time.monotonic() * 1000)))
        lost = watch.check(master, 0)
        if lost:
            break
        time.sleep(0.05)
    assert lost == [1]  # the forged beats did not keep it alive; node 2 beat for real
    assert hb in keys_of(rejected)


def test_a_pause_of_the_watcher_is_not_the_peers_silence(rejected, stores):
    """When the watching agent could not look (it, or the store host, was not
    scheduled: every heartbeat freezes at once), the gap does not count as silence;
    a peer that stays silent while the agent looks is still declared lost."""
    master, ours, _rogue = stores
    membership.register(ours, 1, nproc=2, spare=False)
    hb = protocol.agent_heartbeat_key(1)
    auth.put(ours, hb, "1")
    watch = liveness.PeerWatch(node=0, timeout_s=0.4)
    assert watch.check(master, 0) == []
    time.sleep(0.6)  # the watcher is paused for longer than the timeout; no beats either
    assert watch.check(master, 0) == []  # the previous code declared node 1 lost here
    end = time.monotonic() + 2.0
    lost: list[int] = []
    while time.monotonic() < end and not lost:  # now it watches, and node 1 is silent
        time.sleep(0.05)
        lost = watch.check(master, 0)
    assert lost == [1]


def test_done_records(rejected, stores):
    master, ours, rogue = stores
    watch = liveness.DoneWatch(world_size=2, recheck_s=0.0)
    for r in range(2):
        rogue.set(protocol.done_key(r), "1")
    rogue.set(protocol.DONE_ANY_KEY, "1")
    assert not watch.all_done(master, idle=True)
    assert watch.finished(master) == 0
    protocol.record_done(ours, 0)
    assert watch.finished(master) == 1 and not watch.all_done(master, idle=True)
    protocol.record_done(ours, 1)
    assert not watch.all_done(master, idle=False)  # an agent with running ranks never looks
    assert watch.all_done(master, idle=True)
    assert {protocol.done_key(0), protocol.DONE_ANY_KEY} <= keys_of(rejected)


def test_trained_and_finished_markers(rejected, stores):
    master, ours, rogue = stores
    rogue.set(protocol.trained_key(1), "16")
    rogue.set(protocol.agent_finished_key(1), "1")
    assert not protocol.is_trained(master, 1) and not protocol.agent_finished(master, 1)
    protocol.mark_trained(ours, 1, 16)
    protocol.mark_agent_finished(ours, 1)
    assert protocol.is_trained(master, 1) and protocol.agent_finished(master, 1)


def test_keycheck_tells_a_wrong_secret(rejected, stores):
    master, ours, _ = stores
    assert protocol.keycheck(ours) is None
    protocol.publish_keycheck(master)
    assert protocol.keycheck(ours) is True
    job_store.check_job_key(ours, "here")
    signing.install(Signer(os.urandom(32)))  # an agent started with another secret
    assert protocol.keycheck(ours) is False
    with pytest.raises(job_store.StoreUnavailable, match="job secret is not the one"):
        job_store.check_job_key(ours, "here")


# --- join records and the committed step ------------------------------------------------
def test_join_ignores_forged_records_and_repairs_its_own(rejected, stores):
    master, ours, rogue = stores
    for r in range(2):  # forged records that, if believed, would change the plan
        rogue.set(protocol.join_key(1, r), protocol.JoinRecord(r, 9, 1, True, [3]).to_json())
    mine = protocol.JoinRecord(0, 0, os.getpid(), False, [3], {"1": [3]})
    publish_join(master, 1, protocol.JoinRecord(1, 0, 2, True))  # rank 1 joins first
    real_one = master.get(protocol.join_key(1, 1))
    rogue.set(protocol.join_key(1, 1), b"clobbered")

    def put_back_later() -> int:  # rank 1 repairs its own record, as its wait loop does
        if time.monotonic() > t0 + 0.2:
            master.set(protocol.join_key(1, 1), real_one)
        return 1

    t0 = time.monotonic()
    # Rank 0 completes the count: it plans, from rank 1's real record (no state: it
    # receives from rank 0), never from the forged ones.
    plan = agree(ours, 1, mine, 2, timeout_s=5, current_gen=put_back_later,
                 committed_step=lambda: 3)
    assert plan == (RecoveryPlan(1, 3, {1: 0}, planner=0), None)
    assert published_plan(rogue, 1) == plan
    assert protocol.join_key(1, 1) in keys_of(rejected)
    with pytest.raises(RecoveryImpossible, match=r"ranks \[1\] did not rejoin"):
        rogue.set(protocol.join_key(2, 1), b"forged")
        agree(ours, 2, mine, 2, timeout_s=0.3, current_gen=lambda: 2, committed_step=lambda: 3)
    # A forged count makes rank 0 the planner of generation 3 before rank 1 joined: it
    # waits for a valid record of rank 1, and publishes no plan without one.
    rogue.add(protocol.join_count_key(3), 1)
    rogue.set(protocol.join_key(3, 1), protocol.JoinRecord(1, 9, 1, True, [3]).to_json())
    with pytest.raises(RecoveryImpossible, match=r"ranks \[1\] did not rejoin"):
        agree(ours, 3, mine, 2, timeout_s=0.3, current_gen=lambda: 3, committed_step=lambda: 3)
    assert published_plan(master, 3) is None


def test_committed_step_must_be_sealed(rejected, stores):
    master, ours, rogue = stores
    ledgers = [CommitLedger(c, 2, committed_key="cl/committed_step") for c in (ours, master)]
    assert not ledgers[0].ack(4) and ledgers[1].ack(4)
    assert committed_step(master, "cl/committed_step") == 4
    rogue.set("cl/committed_step", "999")
    with pytest.raises(UntrustedCommit, match="not sealed with the job's key"):
        committed_step(master, "cl/committed_step")
    assert job_outcome.committed_step(master) == "unverified"
