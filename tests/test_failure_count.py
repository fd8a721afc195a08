"""``recovery.max_restarts`` counts failures, not generations.

One node loss took three generations (its watchers' declaration, a failure during the
recovery, the spare node's takeover) and the demo said "recoveries: 3" after two
failures. Each test declares causes on a real TCPStore, with the job key installed,
the way agents and workers do, and checks both counts.
"""

from __future__ import annotations

import os

import pytest

from recovery.generation import protocol
from replication.side_channel import signing
from replication.side_channel.signing import Signer
from tests.helpers.mp import free_port, tcp_store


@pytest.fixture
def store():
    signing.install(Signer(os.urandom(32)))
    server = tcp_store(free_port(), is_master=True)
    yield server
    signing.install(None)


def _exit(rank: int, pid: int) -> dict:
    return {"kind": "worker_exit", "rank": rank, "pid": pid, "signal": "SIGKILL"}


def test_every_declarer_of_one_death_counts_one_failure(store):
    protocol.declare_failure(store, 0, {"kind": "peer_failure", "rank": 2})  # a survivor first
    protocol.declare_failure(store, 0, _exit(1, 4242))  # its agent, deduped into gen 1
    protocol.declare_failure(store, 0, _exit(1, 4242))
    assert (protocol.current_generation(store), protocol.failures(store)) == (1, 1)


def test_a_node_loss_over_three_generations_is_one_failure(store):
    lost = {"kind": "node_lost", "node": 1, "group": 1, "ranks": [2, 3], "agent_pid": 77}
    protocol.declare_failure(store, 0, lost)  # its watchers
    protocol.declare_failure(store, 1, {"kind": "failure_during_recovery", "rank": 0})
    protocol.declare_failure(store, 2, lost)  # the spare node, taking its ranks over
    assert (protocol.current_generation(store), protocol.failures(store)) == (3, 1)
    assert protocol.restart_budget_exceeded(store, 0) is not None
    assert protocol.restart_budget_exceeded(store, 1) is None


def test_distinct_failures_each_count(store):
    protocol.declare_failure(store, 0, _exit(1, 10))
    protocol.declare_failure(store, 1, _exit(1, 11))  # its replacement died too
    protocol.declare_failure(store, 2, {"kind": "exception", "rank": 0, "error": "boom"})
    protocol.declare_failure(store, 3, {"kind": "exception", "rank": 0, "error": "boom"})
    assert protocol.failures(store) == 4
    why = protocol.restart_budget_exceeded(store, 3)
    assert why == "recovery.max_restarts=3 exceeded (4 failures)"


def test_generations_without_failures_stop_as_not_converging(store):
    """Only consequences (say, a partition seen as failed collectives): bounded anyway."""
    gen = 0
    for _ in range(protocol.GENERATIONS_PER_FAILURE * 2 + 1):
        gen = protocol.declare_failure(store, gen, {"kind": "peer_failure", "rank": 0})
    assert protocol.failures(store) == 0
    why = protocol.restart_budget_exceeded(store, 1)
    assert why is not None and why.startswith("recovery is not converging: 9 generations")
