"""Replication across real OS processes: real gloo side group, real TCPStore, no mocks.

Each scenario starts one ``tests.workers.replication_worker`` process per rank. Ranks
are grouped into "nodes" (node = rank // ranks_per_node); every rank trains a tiny model,
calls ``Replicator.snapshot(step)`` each step and reports hashes of what it holds, which
the tests compare across ranks.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from replication.replica_protocol import commit
from tests.helpers.mp import WorkerRun, free_port, run_workers, tcp_store

WORKER = "tests.workers.replication_worker"
BASE: dict[str, Any] = {
    "store_on_rank0": True,
    "ranks_per_node": 2,
    "seed_mode": "rank",
    "steps": 4,
    "factor": 2,
    "timeout_s": 30.0,
    "chunk_bytes": 4096,  # several chunks per segment: exercises the chunked transfer
    "retrain_steps": 3,
    "sleep": None,
    "die": None,
}


def _run(tmp_path: Path, world: int, *, deadline_s: float = 90, poll=None, **cfg) -> WorkerRun:
    """Run ``world`` workers with ``BASE`` updated by ``cfg`` (``timeout_s`` is the
    replication round timeout; ``deadline_s`` bounds the whole run)."""
    cfg = dict(BASE, **cfg)
    cfg["port"] = cfg.get("port") or free_port()
    return run_workers(WORKER, world, cfg, tmp_path, timeout_s=deadline_s, poll=poll)


def _assert_ok(run: WorkerRun, ranks) -> None:
    assert not run.timed_out, run.describe()
    for r in ranks:
        res = run.results.get(r)
        assert res is not None and res.get("ok"), (
            f"rank {r}: {res and res.get('tb')}\n{run.describe()}"
        )


@pytest.fixture(scope="module")
def distinct_run(tmp_path_factory) -> WorkerRun:
    """4 ranks on 2 nodes, k=2, every rank seeded differently (nothing can be deduped)."""
    run = _run(tmp_path_factory.mktemp("distinct"), 4)
    _assert_ok(run, range(4))
    return run


@pytest.fixture(scope="module")
def same_seed_run(tmp_path_factory) -> WorkerRun:
    """Pure data parallelism: identical model/optimizer/rng state; only 'shard' differs."""
    run = _run(tmp_path_factory.mktemp("same"), 4, seed_mode="same")
    _assert_ok(run, range(4))
    return run


def test_ring_places_each_replica_on_the_other_node(distinct_run):
    for res in distinct_run.results.values():
        assert res["node_of_rank"] == [0, 0, 1, 1]
        assert res["holders"] == [[2], [3], [0], [1]]
        assert res["sources"] == [[2], [3], [0], [1]]


def test_every_replica_is_byte_identical_to_its_source(distinct_run):
    res, steps = distinct_run.results, BASE["steps"]
    own = {r: res[r]["own_sha"][str(steps)] for r in res}
    assert len(set(own.values())) == 4, "ranks must hold different state for this test"
    for src in range(4):
        (holder,) = res[src]["holders"][src]
        assert res[holder]["node_of_rank"][holder] != res[src]["node_of_rank"][src]
        replica = res[holder]["replicas"][str(src)]
        assert replica["step"] == steps
        assert replica["sha"] == own[src], f"replica of rank {src} on rank {holder} differs"


def test_restoring_a_replica_rebuilds_the_source_state(distinct_run):
    res, steps = distinct_run.results, BASE["steps"]
    for src in range(4):
        (holder,) = res[src]["holders"][src]
        replica = res[holder]["replicas"][str(src)]
        # params, optimizer moments, scheduler, rng streams, loop counters, shard
        assert replica["restored_digest"] == res[src]["state_digest"][str(steps)]
        assert replica["loop"] == {"step": steps, "rank": src, "history": None}


def test_no_segment_is_skipped_when_ranks_differ(distinct_run):
    res = distinct_run.results
    for r, rr in res.items():
        total = sum(rr["layout"].values())
        assert sorted(int(s) for s in rr["rounds"]) == list(range(1, BASE["steps"] + 1))
        for rd in rr["rounds"].values():
            # every segment that has bytes goes over the wire, each way
            assert rd["bytes_sent"] == total, (r, rd)
            (src,) = rr["sources"][r]
            assert rd["bytes_received"] == sum(res[src]["layout"].values()), (r, rd)


def test_every_rank_commits_the_last_step(distinct_run):
    for res in distinct_run.results.values():
        assert res["committed"] == BASE["steps"]
        assert res["held_steps"] == [BASE["steps"] - 1, BASE["steps"]]


def test_local_restore_replays_bit_exactly(distinct_run):
    steps = str(BASE["steps"])
    for r, res in distinct_run.results.items():
        assert res["after_restore"] == res["state_digest"][steps], r
        assert res["after_first_pass"] != res["state_digest"][steps], "training must change state"
        assert res["second_pass"] == res["first_pass"], r  # losses, then one draw per RNG
        assert res["after_second_pass"] == res["after_first_pass"], r
        # the previous (older) snapshot is intact too: replaying one step from it
        # reproduces the newest snapshot's state exactly
        assert res["older_slot_replayed"] == res["state_digest"][steps], r


def test_pure_data_parallel_skips_identical_segments(same_seed_run):
    res, steps = same_seed_run.results, BASE["steps"]
    for r, rr in res.items():
        layout = rr["layout"]
        for rd in rr["rounds"].values():
            assert rd["segments_skipped"] == len(layout) - 1, (r, rd)
            assert rd["bytes_sent"] == layout["shard"], (r, rd)
            assert rd["bytes_received"] == layout["shard"], (r, rd)
        assert layout["shard"] * 4 < sum(layout.values())
    for src in range(4):
        (holder,) = res[src]["holders"][src]
        replica = res[holder]["replicas"][str(src)]
        assert replica["sha"] == res[src]["own_sha"][str(steps)]
        assert replica["restored_digest"] == res[src]["state_digest"][str(steps)]
        assert replica["loop"]["rank"] == src


def test_factor_three_every_holder_has_an_exact_copy(tmp_path):
    """3 nodes of one rank, k=3: each rank sends to two holders and holds two replicas."""
    steps = 2
    run = _run(tmp_path, 3, ranks_per_node=1, factor=3, steps=steps, retrain_steps=1)
    _assert_ok(run, range(3))
    res = run.results
    for src in range(3):
        holders = res[src]["holders"][src]
        assert sorted(holders) == sorted({0, 1, 2} - {src})
        for holder in holders:
            replica = res[holder]["replicas"][str(src)]
            assert replica["sha"] == res[src]["own_sha"][str(steps)], (src, holder)
            assert replica["restored_digest"] == res[src]["state_digest"][str(steps)]
    for rr in res.values():
        assert rr["committed"] == steps
        layout_total = sum(rr["layout"].values())
        assert all(rd["bytes_sent"] == 2 * layout_total for rd in rr["rounds"].values())


def test_slow_rank_holds_back_the_commit(tmp_path):
    port = free_port()
    store = tcp_store(port, is_master=True)
    samples: list[tuple[float, int]] = []  # (time the read returned, committed step)

    def poll() -> None:  # called by the harness between process checks
        value = commit.committed_step(store)
        samples.append((time.time(), value))

    run = _run(
        tmp_path, 2, port=port, store_on_rank0=False, ranks_per_node=1,
        sleep={"rank": 1, "step": 3, "seconds": 2.0}, poll=poll,
    )
    _assert_ok(run, range(2))
    slow = run.results[1]
    before = [v for t, v in samples if t < slow["snapshot_called_at"]]
    during_sleep = [
        v for t, v in samples if slow["sleep_started_at"] + 0.5 < t < slow["snapshot_called_at"]
    ]
    assert len(during_sleep) >= 10, "the poller must have watched the sleep"
    # Step 3 cannot be committed before the slow rank even took its snapshot of it...
    assert max(before) < 3
    # ...while step 2 committed in the background although the slow rank's loop slept.
    assert set(during_sleep) == {2}
    values = [v for _, v in samples]
    assert values == sorted(values), "the committed step must never go backwards"
    assert commit.committed_step(store) == 4
    fast = run.results[0]
    assert fast["stalls"]["3"] < 1.0, "the fast rank's snapshot must not wait for the slow one"
    assert fast["stalls"]["4"] > 1.0, "the next snapshot waits for the previous round"
    assert fast["committed"] == slow["committed"] == 4


def test_rank_death_mid_round_leaves_step_uncommitted(tmp_path):
    port = free_port()
    store = tcp_store(port, is_master=True)  # the store must outlive the dying rank
    die_step = 3
    run = _run(
        tmp_path, 4, port=port, store_on_rank0=False, steps=die_step, timeout_s=5.0,
        die={"rank": 3, "step": die_step},
    )
    assert not run.timed_out, run.describe()
    assert run.returncodes[3] == 17, run.describe()
    assert run.results[3]["died_at"] == die_step
    _assert_ok(run, range(3))
    for r in range(3):
        res = run.results[r]
        assert res["wait_error"] is not None, f"rank {r}: the failed round went unnoticed"
        assert res["wait_error"]["type"] == "ReplicationError", res["wait_error"]
        assert res["wait_error_after_s"] < 20
        assert res["committed"] == die_step - 1
        assert die_step - 1 in res["held_steps"]
        # the committed step is intact locally and rolls back exactly
        assert res["restored_digest"] == res["state_digest"][str(die_step - 1)]
    # every replica of the committed step survived, including the dead rank's
    own = {r: run.results[r]["own_sha"][str(die_step - 1)] for r in range(4)}
    for src in range(4):
        (holder,) = run.results[0]["holders"][src]
        if holder == 3:
            continue
        replica = run.results[holder]["replicas"][str(src)]
        assert replica.get("sha") == own[src], (src, holder, replica)
    assert commit.committed_step(store) == die_step - 1
    assert store.add(f"checkpointless/acks/{die_step}", 0) < 4


def test_a_replica_corrupted_in_transit_is_refused_and_never_committed(tmp_path):
    """Rank 0's chunks of step 3 arrive with a byte flipped in each. Rank 1 must find the
    checksum wrong on receipt and fail its round, so step 3 is never committed; the
    replica of step 2 it already holds stays intact, and both ranks roll back exactly."""
    port = free_port()
    store = tcp_store(port, is_master=True)
    fail_step = 3
    run = _run(tmp_path, 2, port=port, store_on_rank0=False, ranks_per_node=1,
               steps=fail_step, timeout_s=5.0, corrupt={"rank": 0, "step": fail_step})
    assert not run.timed_out, run.describe()
    _assert_ok(run, range(2))
    receiver, sender = run.results[1], run.results[0]
    err = receiver["wait_error"]
    assert err is not None and err["type"] == "ReplicationError", err
    assert f"replica of rank 0 at step {fail_step}" in err["message"], err
    assert "checksum" in err["message"], err
    # The sender's round cannot complete without the receiver's acknowledgement.
    assert sender["wait_error"] is not None, "the sender committed a refused replica"
    for res in (receiver, sender):
        assert res["committed"] == fail_step - 1
        assert res["restored_digest"] == res["state_digest"][str(fail_step - 1)]
    assert receiver["replicas"]["0"].get("sha") == sender["own_sha"][str(fail_step - 1)], \
        receiver["replicas"]
    assert commit.committed_step(store) == fail_step - 1
