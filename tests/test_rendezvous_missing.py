"""A generation's rendezvous never gives up on a rank whose process is alive and on its
way, and when it does give up, it says what it saw (a real TCPStore, sealed records as
the agents write them)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from recovery.common.errors import RecoveryImpossible
from recovery.generation import protocol
from recovery.generation.rendezvous import RecoveryPlan, agree
from recovery.job_store import auth
from replication.side_channel import signing
from replication.side_channel.signing import Signer
from tests.helpers.mp import free_port, tcp_store

TIMEOUT_S = 1.0


@pytest.fixture
def store():
    signing.install(Signer(os.urandom(32)))
    master = tcp_store(free_port(), is_master=True, timeout_s=30)
    yield master
    signing.install(None)


def _mine() -> protocol.JoinRecord:
    return protocol.JoinRecord(0, 0, os.getpid(), False, [3], {"1": [3]})


def join(store, gen: int, record: protocol.JoinRecord, world_size: int, timeout_s: float,
         current_gen) -> tuple[RecoveryPlan, str | None]:
    """Rank 0's side of the rendezvous (committed step 3)."""
    return agree(store, gen, record, world_size, timeout_s, current_gen, lambda: 3)


class _Agent(threading.Thread):
    """Node 1's agent heartbeat counter, bumped every 0.2 s until stopped."""

    def __init__(self, store) -> None:
        super().__init__(daemon=True)
        self.store, self.stop = store, threading.Event()

    def run(self) -> None:
        seq = 0
        while not self.stop.wait(0.2):
            seq += 1
            auth.put(self.store, protocol.agent_heartbeat_key(1), str(seq))


def test_a_live_process_on_its_way_is_waited_for(store):
    protocol.publish_rank_process(store, 1, node=1, pid=4242, state="running")
    agent = _Agent(store)
    agent.start()
    late = TIMEOUT_S * 4.5  # past several deadlines: no bound on a live process

    theirs: list = []

    def join_late() -> None:  # rank 1's replacement, which completes the join count
        time.sleep(late)
        theirs.append(join(store, 1, protocol.JoinRecord(1, 1, 4242, True), 2,
                           timeout_s=TIMEOUT_S, current_gen=lambda: 1))

    late_rank = threading.Thread(target=join_late, daemon=True)
    late_rank.start()
    t0 = time.monotonic()
    try:
        ours = join(store, 1, _mine(), 2, timeout_s=TIMEOUT_S, current_gen=lambda: 1)
    finally:
        agent.stop.set()
    late_rank.join(10)
    # Rank 1 (pid 4242) came without state and receives it from rank 0.
    # (Rank 1 completes the count and plans, unless rank 0's deadline check found its
    # record first: then rank 0 plans too, and the compare-and-set keeps one plan.)
    assert ours == (RecoveryPlan(1, 3, {1: 0}, ours[0].planner), None) and theirs == [ours]
    assert time.monotonic() - t0 >= late


def test_an_exited_process_is_named_with_its_signal(store):
    protocol.publish_rank_process(store, 1, node=1, pid=4242, state="exited",
                                  exitcode=-9, signal="SIGKILL")
    with pytest.raises(RecoveryImpossible) as err:
        join(store, 1, _mine(), 2, timeout_s=TIMEOUT_S, current_gen=lambda: 1)
    text = str(err.value)
    assert "ranks [1] did not rejoin" in text
    assert "pid 4242 on node 1" in text and "exited with SIGKILL" in text
    assert "no replacement was started" in text


def test_a_process_whose_agent_is_silent_is_given_up(store):
    protocol.publish_rank_process(store, 1, node=1, pid=4242, state="running")
    auth.put(store, protocol.agent_heartbeat_key(1), "7")  # and never again
    t0 = time.monotonic()
    with pytest.raises(RecoveryImpossible, match=r"agent sent no heartbeat .*node lost"):
        join(store, 1, _mine(), 2, timeout_s=TIMEOUT_S, current_gen=lambda: 1)
    assert time.monotonic() - t0 < TIMEOUT_S + 10  # no extension for a silent node


def test_a_rank_nobody_started_says_so(store):
    with pytest.raises(RecoveryImpossible, match=r"no process was ever recorded"):
        join(store, 1, _mine(), 2, timeout_s=TIMEOUT_S, current_gen=lambda: 1)
