"""The commit ledger on a real TCPStore: one client connection per simulated rank."""

from __future__ import annotations

import pytest

from replication.replica_protocol.commit import CommitLedger, CommitTimeout, committed_step
from tests.helpers.mp import free_port, tcp_store


@pytest.fixture
def stores():
    """A master store plus one client connection per rank (like separate processes)."""
    port = free_port()
    master = tcp_store(port, is_master=True, timeout_s=10)
    clients = [tcp_store(port, is_master=False, timeout_s=10) for _ in range(3)]
    return master, clients


def _ledgers(clients, world: int) -> list[CommitLedger]:
    return [CommitLedger(c, world, timeout_s=5) for c in clients[:world]]


def test_nothing_committed_reads_minus_one(stores):
    master, _ = stores
    assert committed_step(master) == -1


def test_a_step_commits_only_when_every_rank_acknowledged(stores):
    master, clients = stores
    ledgers = _ledgers(clients, 3)
    assert ledgers[0].ack(1) is False
    assert ledgers[2].ack(1) is False
    assert committed_step(master) == -1
    with pytest.raises(CommitTimeout, match=r"step 1 was acknowledged by 2/3 ranks"):
        ledgers[0].wait_committed(1, timeout_s=0.3)
    assert ledgers[1].ack(1) is True  # the last acknowledgement completes the commit
    assert committed_step(master) == 1
    for ledger in ledgers:
        ledger.wait_committed(1, timeout_s=1)
        assert ledger.committed_step() == 1


def test_committed_step_advances_round_by_round(stores):
    master, clients = stores
    ledgers = _ledgers(clients, 2)
    seen = []
    for step in (2, 4, 6):
        for ledger in ledgers:
            ledger.ack(step)
        seen.append(committed_step(master))
    assert seen == [2, 4, 6]


def test_forget_deletes_the_counters_of_a_step(stores):
    master, clients = stores
    ledgers = _ledgers(clients, 2)
    for ledger in ledgers:
        ledger.ack(3)
    keys = ["checkpointless/acks/3", "checkpointless/acks/3/done"]
    assert master.check(keys)
    ledgers[0].forget(3)
    assert not master.check([keys[0]]) and not master.check([keys[1]])
    assert committed_step(master) == 3


def test_each_generation_counts_its_own_acknowledgements(stores):
    """A failed round leaves a partial count behind; the next generation (a new ack
    prefix) must not inherit it, while the committed step stays shared."""
    master, clients = stores
    old = [CommitLedger(c, 2, ack_prefix="gen0/acks", timeout_s=5) for c in clients[:2]]
    for ledger in old:
        ledger.ack(4)
    old[0].ack(5)  # rank 1's round for step 5 failed before it acknowledged
    assert committed_step(master) == 4
    new = [CommitLedger(c, 2, ack_prefix="gen1/acks", timeout_s=5) for c in clients[:2]]
    assert new[0].ack(5) is False, "the failed attempt's acknowledgement was counted again"
    assert committed_step(master) == 4
    assert new[1].ack(5) is True
    assert committed_step(master) == 5
