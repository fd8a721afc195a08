"""The scale harness's counters against hand counts, at small N, on a real TCPStore.

If the harness miscounted (a request not seen, a key counted twice, a rank's message
lost), every figure of benchmarks/bench_scale.py and the model built on it would be
wrong; these are the counts one can do on paper from the protocol code.
"""

from __future__ import annotations

import math
import os

import pytest

from benchmarks import scale_model as M
from benchmarks import scale_sim as S
from replication.replica_protocol.commit_tree import depth_of
from replication.side_channel import signing


@pytest.fixture(scope="module")
def pool():
    signing.install(signing.Signer(os.urandom(32)))
    try:
        yield S.StorePool(48)
    finally:
        signing.install(None)


def _record(store):
    from replication.replica_protocol.commit import COMMITTED_KEY

    def record(step: int) -> None:  # as Replicator._record_committed
        store.set(COMMITTED_KEY, signing.seal(COMMITTED_KEY, str(step)))
        store.check([COMMITTED_KEY])

    return record


def test_tree_commit_counts_by_hand(pool):
    """N=8: every rank but 0 sends one ack up, every rank but 0 receives one 'done':
    2*(N-1) messages; rank 0 alone touches the store, 2 requests (set + check)."""
    counter = S.OpCounter()
    record = _record(S.CountingStore(pool.conns[0], counter, 0, prefix="t-tree"))
    res = S.run_tree_commit(8, 3, 1e-4, 0.0, 0.0, record, counter)
    assert res.messages_per_step == 2 * (8 - 1)
    assert res.store_requests_per_step == 2 and res.store_requests_max_node_per_step == 2
    assert counter.ops() == {"set": 3, "check": 3}
    # Virtual time: with no CPU or send cost the latency would be 2*depth hops of the
    # link; the measured protocol CPU can only add to that.
    floor = 2 * depth_of(8) * 1e-4
    assert all(floor <= lat < floor + 0.01 for lat in res.latencies_s), res.latencies_s


def test_virtual_clock_is_the_critical_path():
    """On the real tree shape, with a 10 ms link and no CPU or send cost, the model's
    critical path is exactly 2*depth links."""
    cal = M.Calibration(link_s=0.01, send_s=0.0, record_s=0.0, cpu_per_rank_step_s=0.0,
                        request_s=0.0, per_key_s=0.0)
    for n in (1, 2, 5, 64, 1024):
        assert M.tree_commit_s(n, cal) == pytest.approx(2 * depth_of(n) * 0.01)
    # sends are sequential: rank 0 is busy for its 4 sends of "committed"
    cal2 = M.Calibration(0.0, 0.001, 0.0, 0.0, 0.0, 0.0)
    assert M.tree_commit_s(5, cal2) == pytest.approx(4 * 0.001)


def test_store_count_counts_by_hand(pool):
    """N=8, replication.commit=store: each rank adds once and waits once (on its own
    clone); the completer sets the sealed committed key and the done key."""
    res = S.run_ledger_commit(pool, 8, 2, 4, "t-ledger")
    assert res.ops_per_step == {"add": 8, "wait": 8, "set": 2}
    assert res.requests_per_step == 18
    # a node's 4 ranks: 4 adds + 4 waits, plus the 2 sets in the steps one of them
    # completed the count (which rank does varies from step to step)
    assert 8 <= res.requests_max_node_per_step <= 10


def test_liveness_counts_by_hand(pool):
    """Per period, the ring watch (ADR 0023) reads the liveness version with one
    compare-and-set (1 request, 1 key) and its two watched neighbours' heartbeats in one
    multi_get (1 request, 2 keys): 2 requests and 3 keys at any job size. A beat at
    generation 0: the sealed set, the owner record (check + get, reassert_owner) and one
    check of the next generation's cause key (reassert_generations): 4 requests."""
    for nodes in (4, 8):
        res = S.run_liveness(pool, nodes, 2, 0.1, 2, f"t-live{nodes}", offset=8)
        assert res.lost == 0
        assert res.check_requests_per_agent == 2, (nodes, res)
        assert res.check_keys_per_agent == 3, (nodes, res)
        assert res.beat_requests_per_agent == 4, (nodes, res)


def test_rendezvous_plans_agree_and_count(pool):
    """16 ranks on 4 nodes lose node 1: its 4 ranks are the newcomers, each served by a
    rank on another node, and every rank derived the same plan."""
    res = S.run_rendezvous(pool, 16, 4, 2, lost_node=1, gen=1, tag="t-rdzv")
    assert res.providers_ok and res.newcomers == 4
    assert res.requests > 0 and res.keys >= res.requests


def test_fits_recover_their_law():
    xs = [8, 64, 512, 4096]
    p = M.best_fit(xs, [3.0 * x ** 1.5 for x in xs])
    assert p["best"] == "a*N^b" and p["exponent"] == pytest.approx(1.5)
    g = M.best_fit(xs, [2.0 + 0.5 * math.log2(x) for x in xs])
    assert g["best"] == "a+b*log2(N)" and g["log"]["b"] == pytest.approx(0.5)


def test_data_plane_counts_by_hand():
    """A ring's 2(N-1)/N of the gradients with default settings, the same for the opt-in
    ordered sum, (N-1)x for the all-gather-then-add it replaced; (k-1) states per
    snapshot interval for replication."""
    from benchmarks.scale_model import Assumptions, data_plane_bytes_per_rank_per_step

    a = Assumptions(grad_bytes_per_rank=1000.0, state_bytes_per_rank=800.0,
                    replication_factor=2, snapshot_interval_steps=8)
    got = data_plane_bytes_per_rank_per_step(16384, a)
    assert got["allreduce"] == got["allreduce_ordered"] == 2 * 16383 / 16384 * 1000.0
    assert got["allreduce_gather_sum"] == 16383 * 1000.0
    assert got["replication"] == 100.0
    assert got["total_default"] == got["allreduce"] + 100.0


def test_detection_follows_how_the_node_was_lost():
    """The model's detection is the product's: closed connections for a crashed agent,
    keepalive for a silent machine (launcher/peer_link.py's settings), the heartbeat
    timeout for a stalled agent; an unknown kind is refused."""
    from launcher import peer_link

    model = M
    a = model.Assumptions(heartbeat_timeout_s=15.0, heartbeat_interval_s=1.0)
    keepalive = (peer_link.KEEPALIVE_IDLE_S
                 + peer_link.KEEPALIVE_COUNT * peer_link.KEEPALIVE_INTERVAL_S)
    assert model.detection_s(a, "crashed") == 3.0
    assert model.detection_s(a, "silent") == keepalive + 3.0
    assert model.detection_s(a, "stalled") == 16.0
    assert model.detection_s(a, "crashed") < model.detection_s(a, "silent") \
        < model.detection_s(a, "stalled")
    with pytest.raises(ValueError, match="detection kind"):
        model.detection_s(a, "vanished")


def test_sharded_recovery_costs_count_by_hand():
    """FSDP moves two all-gathers of the weights and a reduce-scatter of the gradients;
    a per-step snapshot sends the rank's whole shard of the state, the log its
    gradient shard; a holder of the log keeps the replica plus a shard per step."""
    from benchmarks.scale_model import ShardedJob, sharded_recovery_costs

    job = ShardedJob(params=6400.0, n=64, param_bytes=2, grad_bytes=2,
                     state_bytes_per_param=12, replication_factor=2, interval_steps=10)
    got = sharded_recovery_costs(job)
    assert got["fsdp_bytes_per_step"] == pytest.approx(6 * 6400 * 63 / 64)
    assert got["per_step_snapshot_bytes_per_step"] == 12 * 100
    assert got["update_log_bytes_per_step"] == 2 * 100
    assert got["per_step_snapshot_over_fsdp"] == pytest.approx(2 / 63)
    assert got["update_log_holder_bytes"] == 1200 + 10 * 200
    assert got["update_log_steps_per_state_of_memory"] == 6
