"""The device snapshot tier (``replication.device: auto | host | cuda``) on a CPU host.

The tier is written against torch's device API and parameterised by its device, so
these tests run it with the CPU as the "device": every code path (the decision after
the first step, the device buffers, the device-to-device capture and restore, the
staging into host memory that hashes each chunk, the fallback to host memory) runs
here; only real streams, real ``mem_get_info`` figures and the absence of PCIe traffic
need ``make test-gpu``.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from recovery.recipe import load_config
from replication.config import ReplicationConfig
from replication.snapshots import device_tier
from replication.snapshots.device_tier import DeviceTier, DeviceTierError
from replication.snapshots.digest_copy import compute_digests, verify_segments
from replication.snapshots.snapshot import SnapshotEngine
from replication.training_state.layout import flatten
from replication.training_state.snapshot_meta import SnapshotError
from replication.training_state.state import TrainingState
from tests.helpers.training import digest, make_model, seed_all, train_step

CPU = torch.device("cpu")
ROOMY = (1 << 40, 1 << 41)  # (free, total) of a device with room for anything


def _job(seed: int = 3) -> tuple[TrainingState, dict[str, Any]]:
    seed_all(seed)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    state = TrainingState()
    for name, obj in (("model", model), ("optim", opt), ("sched", sched)):
        state.register(name, obj)
    return state, {"model": model, "opt": opt, "sched": sched}


def _step(objs: dict[str, Any]) -> None:
    train_step(objs["model"], objs["opt"], objs["sched"])


def _tier(info: tuple[int, int] = ROOMY, **kw: Any) -> DeviceTier:
    return DeviceTier(CPU, mem_get_info=lambda _d: info, **kw)


def _engine(state: TrainingState, tier: DeviceTier | None, **kw: Any) -> SnapshotEngine:
    return SnapshotEngine(state, pin_memory=False, device_tier=tier, **kw)


def _run(engine: SnapshotEngine, objs: dict[str, Any], steps: int) -> None:
    """Initial capture as step 0, then train and capture ``steps`` steps, sealing each."""
    engine.seal(engine.capture(0))
    for s in range(1, steps + 1):
        _step(objs)
        engine.seal(engine.capture(s))
        engine.protect(s)


def test_capture_seal_restore_bit_exact_through_the_device_tier():
    state, objs = _job()
    tier = _tier()
    engine = _engine(state, tier, overlap=True)
    engine.seal(engine.capture(0))
    assert tier.active is None and not engine.slots[0].on_device  # before the first step
    _step(objs)
    slot = engine.capture(1)
    assert tier.active is True and slot.on_device and slot.device_buffer is not None
    meta = engine.seal(slot)
    engine.protect(1)
    want = digest(state.capture())
    # The seal staged the device bytes into the host buffer and hashed them as it did.
    assert torch.equal(slot.buffer[: meta.layout.nbytes], slot.device_buffer)
    verify_segments(slot.buffer, meta)
    assert meta.digests == compute_digests(slot.buffer, meta.layout, meta.skeletons)
    for _ in range(3):
        _step(objs)
    assert digest(state.capture()) != want
    # The rollback reads the device buffer: a damaged host copy does not reach it.
    slot.buffer.zero_()
    engine.restore(1)
    assert digest(state.capture()) == want
    assert engine.device_bytes == sum(s.layout.nbytes for s in engine.slots if s.on_device)


def test_the_device_tiers_digests_are_the_host_tiers():
    """Replicas and durable checkpoints verify against the digests whichever tier made
    them: the same state hashes the same."""
    metas = []
    for tier in (None, _tier()):
        state, objs = _job(seed=5)
        engine = _engine(state, tier)
        _run(engine, objs, 2)
        slot = engine.slot_for(2)
        assert slot.on_device is (tier is not None)
        metas.append(slot.meta())
    host, device = metas
    assert host.layout == device.layout and host.skeletons == device.skeletons
    assert host.digests == device.digests


def test_staging_hashes_every_chunk_of_a_large_segment(monkeypatch):
    """Segments larger than a staging chunk are staged and hashed in pieces."""
    monkeypatch.setattr(device_tier, "STAGE_CHUNK", 1000)
    state, objs = _job()
    engine = _engine(state, _tier())
    _run(engine, objs, 1)
    slot = engine.slot_for(1)
    assert max(seg.nbytes for seg in slot.layout.segments) > 4 * 1000
    assert slot.on_device
    assert slot.digests == compute_digests(slot.buffer, slot.layout, slot.skeletons)


def test_no_room_on_the_device_falls_back_to_host_memory_with_a_log_line(caplog):
    state, objs = _job()
    _step(objs)  # the optimizer's state exists: the size the decision will see
    need = 2 * flatten(state.capture()).layout.nbytes
    # Free memory covers the slots, but not with 10 % of the device kept free.
    tier = _tier(info=(need + 100, 10 * need))
    engine = _engine(state, tier)
    with caplog.at_level(logging.INFO, logger="checkpointless.replication"):
        _run(engine, objs, 2)
    assert tier.active is False
    assert not any(s.on_device for s in engine.slots) and engine.device_bytes == 0
    lines = [r.getMessage() for r in caplog.records if "snapshot copies" in r.getMessage()]
    assert len(lines) == 1 and "host tier" in lines[0] and "do not fit" in lines[0]
    state_before = digest(state.capture())
    _step(objs)
    engine.restore(2)  # from host memory
    assert digest(state.capture()) == state_before


def test_the_budget_counts_what_the_tier_already_holds():
    """Device buffers the tier holds are counted as free: it would reuse them."""
    tier = _tier(info=(1000, 10_000), headroom=0.0)
    assert tier.decide([], need=1500, held=600) is True
    tier = _tier(info=(1000, 10_000), headroom=0.0)
    assert tier.decide([], need=1500, held=0) is False


def test_auto_without_gpu_tensors_is_the_host_tier(caplog):
    state, objs = _job()
    tier = DeviceTier(None, mem_get_info=lambda _d: ROOMY)
    engine = _engine(state, tier)
    with caplog.at_level(logging.INFO, logger="checkpointless.replication"):
        _run(engine, objs, 2)
    assert tier.active is False and engine.device_bytes == 0
    assert any("host tier: no state tensor is on a GPU" in r.getMessage()
               for r in caplog.records)


def test_a_required_device_tier_that_does_not_fit_is_an_error():
    state, objs = _job()
    engine = _engine(state, _tier(info=(1, 1 << 20), required=True))
    engine.seal(engine.capture(0))
    _step(objs)
    with pytest.raises(DeviceTierError, match=r"^replication\.device=cuda cannot be used: .*"
                                              r"do not fit") as info:
        engine.capture(1)
    assert "\n" not in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_cuda_on_a_host_without_cuda_is_one_clear_error_at_start():
    from replication.replica_protocol.replicator import Replicator

    with pytest.raises(DeviceTierError) as info:
        Replicator(TrainingState(), store=torch.distributed.HashStore(), rank=0,
                   world_size=1, node=0, config=ReplicationConfig(device="cuda"))
    msg = str(info.value)
    assert "\n" not in msg and "replication.device=cuda" in msg and "no CUDA device" in msg


@pytest.mark.parametrize("value", ["cpu", "host", "auto", "cuda"])
def test_recipes_load_every_device_setting_including_the_old_cpu(value):
    cfg = load_config(None, [f"replication.device={value}"], env={})
    assert cfg.replication.device == value


def test_the_default_is_auto():
    assert ReplicationConfig().device == "auto"


@pytest.mark.parametrize(("value", "tiered"), [("cpu", False), ("host", False), ("auto", True)])
def test_the_replicator_builds_the_tier_the_setting_names(value, tiered):
    """'cpu' (older recipes) is the host tier, as 'host' is; 'auto' may use a device."""
    from replication.replica_protocol.replicator import Replicator

    rep = Replicator(TrainingState(), store=torch.distributed.HashStore(), rank=0,
                     world_size=1, node=0, config=ReplicationConfig(device=value, factor=1))
    try:
        assert (rep.engine.tier is not None) is tiered
    finally:
        rep.close()


def test_a_received_snapshot_restores_from_host_memory():
    """A slot filled over the network (a replacement's own state) holds host bytes
    only: its stale device buffer must not be restored."""
    state, objs = _job()
    engine = _engine(state, _tier())
    _run(engine, objs, 3)  # slots hold steps 2 and 3 on the device
    meta = engine.slot_for(3).meta()
    image = engine.slot_for(3).buffer.clone()
    want = digest(state.capture())
    engine.protect(3)
    slot = engine.incoming_slot(meta.layout)
    assert slot.device_buffer is not None  # the buffer of step 2 is still there
    slot.buffer.copy_(image)
    engine.adopt(slot, meta)
    _step(objs)
    engine.restore(3)  # one of two slots holds step 3; the adopted one is host-only
    assert digest(state.capture()) == want
    assert not slot.on_device



def test_a_seal_overtaken_by_a_new_capture_of_its_slot_is_refused():
    """A round abandoned in a recovery may still be staging a slot when the next
    generation captures into it: its digests must not be pinned on the new bytes."""
    state, objs = _job()
    tier = _tier()
    engine = _engine(state, tier)
    _run(engine, objs, 1)  # step 1 committed: the next captures take the other slot
    _step(objs)
    slot = engine.capture(2)
    stage = tier.stage

    def overtaken(*args: Any) -> dict[str, str]:
        digests = stage(*args)
        _step(objs)
        assert engine.capture(3) is slot  # the only free slot
        return digests

    tier.stage = overtaken  # type: ignore[method-assign]
    with pytest.raises(SnapshotError, match="reused before its round sealed it"):
        engine.seal(slot)
    tier.stage = stage  # type: ignore[method-assign]
    meta = engine.seal(slot)
    assert meta.step == 3
    verify_segments(slot.buffer, meta)



def test_the_durable_tier_persists_a_device_resident_snapshot_from_its_staged_bytes(tmp_path):
    """The durable writer reads a slot's host buffer (zero-copy: straight from shared
    memory); for a device-tier slot that is what the seal staged, and the checkpoint
    verifies and loads bit-exactly."""
    from replication.durable import DurableWriter, load, read_snapshot
    from tests.test_durable_support import config, make_state, snapshot, train

    state, objs = make_state()
    engine = SnapshotEngine(state, shared_memory=True, num_slots=3, device_tier=_tier())
    snapshot(engine, 0)
    train(objs)
    meta, buf = snapshot(engine, 1)
    assert engine.slot_for(1).on_device
    want = digest(state.capture())
    with DurableWriter(config(str(tmp_path)), 0, 1, zero_copy=True) as writer:
        result = writer.submit(meta, buf).result(120)
        assert result.status == "ok" and result.committed, result
    got_meta, got = read_snapshot(str(tmp_path / "step_1"))
    assert got_meta.digests == meta.digests
    assert torch.equal(got, engine.slot_for(1).device_buffer)
    fresh, _ = make_state(seed=9)
    assert load(str(tmp_path), fresh).step == 1
    assert digest(fresh.capture()) == want


# -- a real 2-process job -----------------------------------------------------------------
# The replication worker of tests/test_replication_mp.py, run with the device tier on the
# CPU: this module is the worker's entry point (see the bottom), so the worker itself is
# unchanged and its checks are the same.


def test_two_processes_replicate_and_restore_bit_exactly_through_the_device_tier(tmp_path):
    """2 ranks on 2 nodes, factor 2, each rank's own snapshots in the (CPU) device tier:
    each replica is byte-identical to its source's staged snapshot and rebuilds the
    source's exact state (what a replacement of a killed rank receives), and a local
    rollback from the device buffer replays bit-exactly."""
    from tests.helpers.mp import free_port, run_workers

    cfg = {"store_on_rank0": True, "ranks_per_node": 1, "seed_mode": "rank", "steps": 4,
           "factor": 2, "timeout_s": 30.0, "chunk_bytes": 4096, "retrain_steps": 3,
           "sleep": None, "die": None, "port": free_port()}
    run = run_workers("tests.test_device_tier", 2, cfg, tmp_path, timeout_s=120)
    assert not run.timed_out, run.describe()
    res = run.results
    for r in range(2):
        assert res.get(r) and res[r].get("ok"), f"rank {r}: {res.get(r)}\n{run.describe()}"
        assert res[r]["tier_active"] is True and res[r]["device_bytes"] > 0
        assert res[r]["on_device"] == [True, True]  # steps 3 and 4, both slots
    steps = cfg["steps"]
    for src in range(2):
        holder = 1 - src
        replica = res[holder]["replicas"][str(src)]
        assert replica["sha"] == res[src]["own_sha"][str(steps)]
        assert replica["restored_digest"] == res[src]["state_digest"][str(steps)]
        mine = res[src]
        assert mine["after_restore"] == mine["state_digest"][str(steps)]
        assert mine["after_second_pass"] == mine["after_first_pass"]
        assert mine["first_pass"] == mine["second_pass"]


def _worker_main(cfg: dict[str, Any]) -> dict[str, Any]:
    """The replication worker, its replicator's device tier on the CPU."""
    from replication.replica_protocol.replicator import Replicator
    from tests.workers import replication_worker as worker

    made: list[Replicator] = []

    def replicator(*args: Any, **kwargs: Any) -> Replicator:
        rep = Replicator(*args, tier_device=CPU, **kwargs)
        made.append(rep)
        return rep

    worker.Replicator = replicator  # type: ignore[assignment]
    result = worker.main(cfg)
    engine = made[0].engine
    assert engine.tier is not None
    result["tier_active"] = engine.tier.active
    result["device_bytes"] = engine.device_bytes
    result["on_device"] = [s.on_device for s in engine.slots]
    replicas = made[0].replicas
    result["replicas_on_device"] = [replicas.get(src, step).on_device
                                    for src, steps in replicas.held_steps().items()
                                    for step in steps]
    result["replica_device_bytes"] = replicas.device_nbytes()
    return result


if __name__ == "__main__":
    import json
    import sys
    import traceback

    from tests.helpers.mp import write_result

    config = json.loads(sys.argv[1])
    try:
        out = _worker_main(config)
        out["ok"] = True
    except BaseException as exc:
        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
               "tb": traceback.format_exc()}
    write_result(config["out"], config["rank"], out)
    sys.stdout.flush()
