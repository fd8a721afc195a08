"""Replicas held for peers in the device tier (``replication.replica_protocol.replica_tier``), on a
CPU host.

As in ``tests/test_device_tier.py``, the tier's device is the CPU: every path runs here
(the decision per replica, the budget shared with the own slots, the staged receive
that hashes each host chunk before copying it to the device buffer, the staged send a
provider serves a replacement with, a reseed into a device replica); only real streams
and real free-memory figures need ``make test-gpu``. The two-process tests use real
processes, a real TCPStore and the real gloo side channel.
"""

from __future__ import annotations

from typing import Any

import torch

from replication.replica_protocol.replica_tier import RING_CHUNKS, wants_device
from replication.replica_protocol.replicas import ReplicaStore
from replication.snapshots.device_tier import DeviceTier

CPU = torch.device("cpu")
MiB = 1 << 20


def _active_tier(budget: int, own: int) -> DeviceTier:
    """A CPU "device" tier decided active with ``budget`` bytes, ``own`` of them for the
    own snapshot slots."""
    tier = DeviceTier(CPU, mem_get_info=lambda _d: (budget, 1 << 40), headroom=0.0)
    assert tier.decide([], own, 0)
    return tier


# -- where a replica goes -------------------------------------------------------------------


def test_a_mostly_received_replica_goes_to_the_device_tier():
    tier = _active_tier(10 * MiB, own=2 * MiB)
    store = ReplicaStore(tier=tier)
    slot = store.writable(1, MiB, received=MiB)
    assert slot.on_device and slot.buffer is not None and slot.buffer.numel() == MiB
    assert store.device_nbytes() == MiB and store.nbytes() == 0  # host budget counts 0


def test_a_data_parallel_replica_stays_in_host_memory():
    """Its segments are shared with the own snapshot: a device buffer would hold the
    whole layout for the few bytes that arrive."""
    tier = _active_tier(10 * MiB, own=2 * MiB)
    store = ReplicaStore(tier=tier)
    slot = store.writable(1, MiB, received=MiB // 10)
    assert not slot.on_device and store.device_nbytes() == 0
    assert not wants_device(MiB, MiB // 2 - 1) and wants_device(MiB, MiB // 2)


def test_replicas_use_only_the_budget_the_own_slots_leave():
    tier = _active_tier(5 * MiB, own=2 * MiB)
    store = ReplicaStore(tier=tier)
    first = store.writable(1, MiB, received=MiB)
    store.adopt(first, _meta(5))
    second = store.writable(1, MiB, received=MiB)  # the other slot of the same source
    assert second is not first
    third = store.writable(2, 2 * MiB, received=2 * MiB)  # 2 + 2 + 2 > 5: host
    assert first.on_device and second.on_device and not third.on_device
    assert store.device_nbytes() == 2 * MiB
    assert not tier.admit(4 * MiB)  # the own slots growing past what replicas leave


def test_without_an_active_tier_or_a_received_count_replicas_are_host_memory():
    undecided = DeviceTier(CPU, mem_get_info=lambda _d: (1 << 40, 1 << 41))
    assert not ReplicaStore(tier=undecided).writable(1, MiB, received=MiB).on_device
    assert not ReplicaStore().writable(1, MiB, received=MiB).on_device
    roomy = _active_tier(10 * MiB, own=MiB)
    assert not ReplicaStore(tier=roomy).writable(1, MiB).on_device  # received unknown


def test_a_replica_moving_between_tiers_keeps_the_budget_exact():
    tier = _active_tier(6 * MiB, own=2 * MiB)
    store = ReplicaStore(tier=tier)
    a = store.writable(1, MiB, received=MiB)
    assert a.on_device and store.device_nbytes() == MiB
    store.adopt(a, _meta(5))
    b = store.writable(1, 2 * MiB, received=2 * MiB)  # the state grew: a new buffer
    assert b is not a and b.on_device and store.device_nbytes() == 3 * MiB
    store.adopt(b, _meta(6))
    c = store.writable(1, 2 * MiB, received=1)  # now shared: back to host memory
    assert c is a and not c.on_device and store.device_nbytes() == 2 * MiB
    # What the tier still counts is exactly what is held: 2 MiB more fit, 3 MiB do not.
    assert tier.reserve_replica(2 * MiB) and not tier.reserve_replica(MiB)


def _meta(step: int) -> Any:
    from replication.training_state.layout import SnapshotLayout
    from replication.training_state.snapshot_meta import SnapshotMeta

    return SnapshotMeta(step, SnapshotLayout([], 0), {}, {})


# -- real processes -------------------------------------------------------------------------


def test_rounds_hold_replicas_on_the_device_and_they_rebuild_their_source_exactly(tmp_path):
    """2 ranks, factor 2, different states (nothing shared): each rank's replica of the
    other arrives through the staging ring into a device buffer, and rebuilds the
    source's exact staged snapshot and state (what a replacement would receive)."""
    run = _run("tests.test_device_tier", tmp_path, steps=4)
    res = run.results
    for r in range(2):
        assert res.get(r) and res[r].get("ok"), f"rank {r}: {res.get(r)}\n{run.describe()}"
        assert res[r]["replicas_on_device"] == [True, True], res[r]
        assert res[r]["replica_device_bytes"] > 0 and res[r]["replica_store_bytes"] == 0
    for src in range(2):
        replica = res[1 - src]["replicas"][str(src)]
        assert replica["sha"] == res[src]["own_sha"]["4"]
        assert replica["restored_digest"] == res[src]["state_digest"]["4"]


def test_a_corrupted_chunk_bound_for_a_device_replica_is_refused(tmp_path):
    """Rank 1 flips a byte of every chunk of step 3's round in transit: rank 0, receiving
    through the staging ring, refuses the replica instead of keeping it."""
    run = _run("tests.test_device_tier", tmp_path, steps=4, corrupt={"rank": 1, "step": 3})
    res = run.results
    assert res.get(0) and res[0].get("ok"), run.describe()
    assert res[0]["wait_error"] is not None, res[0]
    assert "checksum" in res[0]["wait_error"]["message"].lower(), res[0]["wait_error"]
    assert res[0]["replicas"]["1"].get("step") == 2  # the committed copy is intact


def test_a_replacement_is_served_from_a_device_replica_and_reseeds_into_one(tmp_path):
    """Rank 1 is replaced by a new process state: rank 0 serves it its state from the
    device replica (staged through host chunks) and it restores bit-exactly; a reseed
    into a store whose tier is active lands the peer's snapshot on the device."""
    run = _run("tests.test_replica_tier", tmp_path, steps=3)
    res = run.results
    for r in range(2):
        assert res.get(r) and res[r].get("ok"), f"rank {r}: {res.get(r)}\n{run.describe()}"
    assert res[0]["served_from_device"] is True
    assert res[1]["restored"] == res[1]["before_loss"]  # the newcomer's state is rank 1's
    assert res[1]["moved"] > 0
    for r in range(2):
        assert res[r]["reseeded_on_device"] is True
        assert res[r]["reseeded_sha"] == res[1 - r]["own_sha"]


def _run(module: str, tmp_path: Any, steps: int, **extra: Any) -> Any:
    """Two workers of ``module`` (``tests.test_device_tier``'s replication worker, or
    this module's handover worker), whose results the caller checks. The GPU check
    (``tests/gpu/more_checks.py``) runs this module's worker with ``device="cuda:0"``."""
    from tests.helpers.mp import free_port, run_workers

    # Chunks smaller than the state and more of them than the ring holds: the ring's
    # reuse (a chunk posted again only after its copy ended) is exercised.
    cfg = {"store_on_rank0": True, "ranks_per_node": 1, "seed_mode": "rank",
           "steps": steps, "factor": 2, "timeout_s": 30.0, "chunk_bytes": 512,
           "retrain_steps": 2, "sleep": None, "die": None, "port": free_port(), **extra}
    run = run_workers(module, 2, cfg, tmp_path, timeout_s=120)
    assert not run.timed_out, run.describe()
    return run


def _worker_main(cfg: dict[str, Any]) -> dict[str, Any]:
    """Generation 1: replicate ``steps`` steps with device replicas. Generation 2: rank 1
    drops everything (a replacement) and receives its state from rank 0's device
    replica. Then both reseed into fresh stores with an active tier."""
    from replication.config import ReplicationConfig
    from replication.replica_protocol.handover import reseed_replicas
    from replication.replica_protocol.replicas import ReplicaStore
    from replication.replica_protocol.replicator import Replicator
    from tests.helpers.mp import tcp_store
    from tests.helpers.training import buffer_sha, seed_all
    from tests.workers import replication_worker as worker

    rank, steps = cfg["rank"], cfg["steps"]
    device = torch.device(cfg.get("device", "cpu"))  # the GPU check passes "cuda:0"
    torch.set_num_threads(1)
    store = tcp_store(cfg["port"], is_master=rank == 0)
    config = ReplicationConfig(factor=2, timeout_s=cfg["timeout_s"],
                               chunk_bytes=cfg["chunk_bytes"])

    def replicator(state: Any, gen: int, previous: Replicator | None) -> Replicator:
        return Replicator(state, store=store, rank=rank, world_size=2, node=rank,
                          config=config, prefix=f"t/g{gen}", previous=previous,
                          tier_device=device)

    seed_all(1000 + rank)
    state, objs = worker.build(rank)
    rep = replicator(state, 1, None)
    for s in range(1, steps + 1):
        worker.step(objs)
        rep.snapshot(s)
    rep.wait()
    res: dict[str, Any] = {"before_loss": worker.state_digest(state)}
    rslot = rep.replicas.get(1 - rank, steps)
    assert rslot.on_device and rslot.buffer is not None
    assert rslot.buffer.numel() > RING_CHUNKS * cfg["chunk_bytes"]  # the ring is reused

    # Generation 2: rank 1 is a new process state (nothing held, different values).
    if rank == 1:
        seed_all(7)
        state, objs = worker.build(rank)
        new = replicator(state, 2, None)
    else:
        new = replicator(state, 2, rep)
        res["served_from_device"] = new.replica_source(1, steps).ring is not None
    out = new.recover(steps, {1: 0})
    res["restored"] = worker.state_digest(state)
    res["moved"] = out.moved

    # A reseed into a store whose tier is active (a takeover moved the placement).
    fresh = ReplicaStore(tier=new.engine.tier if rank == 0 else rep.engine.tier,
                         chunk_bytes=cfg["chunk_bytes"])
    own = new.engine.slot_for(steps)
    reseed_replicas(new.channel, rank, new.holders, new.sources[rank], steps, own.meta(),
                    lambda seg: own.segment_bytes(seg.name), fresh, cfg["chunk_bytes"],
                    dedupe=False)
    got = fresh.get(1 - rank, steps)
    res["reseeded_on_device"] = got.on_device
    res["reseeded_sha"] = buffer_sha(got.host_copy())
    res["own_sha"] = buffer_sha(own.buffer)
    new.channel.barrier()
    new.close()
    return res


if __name__ == "__main__":
    import json
    import sys
    import traceback

    from tests.helpers.mp import write_result

    config = json.loads(sys.argv[1])
    try:
        result = _worker_main(config)
        result["ok"] = True
    except BaseException as exc:
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                  "tb": traceback.format_exc()}
    write_result(config["out"], config["rank"], result)
    sys.stdout.flush()

