"""Local snapshots: bit-exact capture/restore of every kind of training state,
double buffering, and checksum verification (single process)."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import xxhash
from torch.nn.parallel import DistributedDataParallel

from replication.replica_protocol.replicas import ReplicaStore
from replication.snapshots import checksum
from replication.snapshots.digest_copy import compute_digests, segment_trailer, verify_segments
from replication.snapshots.snapshot import SnapshotEngine
from replication.training_state import codec
from replication.training_state.snapshot_meta import SnapshotError
from replication.training_state.state import TrainingState
from tests.helpers.training import (
    assert_tree_equal,
    make_model,
    rng_draws,
    seed_all,
    train_step,
)


def _snapshot_at(engine: SnapshotEngine, step: int) -> None:
    slot = engine.capture(step)
    engine.seal(slot)
    engine.protect(step)


def _live(objs: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of every object's state dict (not aliasing live tensors)."""
    return {name: copy.deepcopy(obj.state_dict()) for name, obj in objs.items()}


def _check_round_trip(
    objs: dict[str, Any], one_step: Callable[[], float], *, warmup: int = 3, replay: int = 3
) -> None:
    """Train, snapshot, train on, restore, train again: the replay must be bit-exact."""
    state = TrainingState()
    for name, obj in objs.items():
        state.register(name, obj)
    engine = SnapshotEngine(state)
    for _ in range(warmup):
        one_step()
    _snapshot_at(engine, warmup)
    at_snapshot = _live(objs)

    first = [one_step() for _ in range(replay)] + rng_draws()
    after_first = _live(objs)
    with pytest.raises(AssertionError):  # the replay must have something to reproduce
        assert_tree_equal(after_first, at_snapshot)

    engine.restore(warmup)
    assert_tree_equal(_live(objs), at_snapshot)
    second = [one_step() for _ in range(replay)] + rng_draws()
    assert second == first  # losses and one draw from each RNG stream, exactly
    assert_tree_equal(_live(objs), after_first)

    # Training after a restore must not have written into the snapshot (no aliasing of
    # the buffer by restored optimizer/user state): a second restore replays again.
    engine.restore(warmup)
    assert [one_step() for _ in range(replay)] + rng_draws() == first


@pytest.mark.parametrize(
    "make_opt",
    [
        pytest.param(lambda p: torch.optim.Adam(p, lr=1e-2), id="adam"),
        pytest.param(lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9), id="sgd-momentum"),
        pytest.param(lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True), id="adamw-amsgrad"),
    ],
)
def test_module_optimizer_scheduler_rng_round_trip(make_opt):
    seed_all(0)
    model = make_model()
    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=20)
    _check_round_trip(
        {"model": model, "optim": opt, "sched": sched},
        lambda: train_step(model, opt, sched),
    )


def test_batchnorm_buffers_round_trip():
    seed_all(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.5)
    _check_round_trip({"model": model, "optim": opt}, lambda: train_step(model, opt))
    assert int(model[1].num_batches_tracked) == 6  # the int64 buffer was restored as well


@pytest.fixture
def single_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ddp_wrapped_module_round_trip(single_rank_group):
    seed_all(2)
    ddp = DistributedDataParallel(make_model())
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    _check_round_trip({"model": ddp, "optim": opt}, lambda: train_step(ddp, opt))
    assert all(k.startswith("module.") for k in ddp.state_dict())


def test_grad_scaler_round_trip():
    try:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    except Exception as exc:  # pragma: no cover - depends on the torch build
        pytest.skip(f"torch.amp.GradScaler('cpu') does not construct here: {exc}")
    if not scaler.is_enabled():  # pragma: no cover
        pytest.skip("GradScaler('cpu') is disabled in this torch build (empty state)")
    seed_all(3)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    _check_round_trip(
        {"model": model, "optim": opt, "scaler": scaler},
        lambda: train_step(model, opt, scaler=scaler),
    )
    assert scaler.get_scale() > 2.0**8  # growth happened, so the scale was part of the replay


class Zoo:
    """A user object whose state uses every kind of leaf the codec supports."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {
            "nested": {"list": [1, 2.5, "s", None, True], "tuple": (1, (2, (3,)), [4]),
                       "empty": {}, "empty_list": [], "empty_tuple": ()},
            "int_keys": {0: "zero", -7: "neg", 2**70: "big"},
            "tuple_key": {(1, "a"): "tk"},
            "floats": [float("nan"), float("inf"), float("-inf"), -0.0, 5e-324, 0.1],
            "str": "héllo ✓", "bytes": b"\x00\xffraw", "bool": False, "none": None,
            "arrays": {
                "f64": np.arange(6, dtype=np.float64).reshape(2, 3),
                "i32": np.array([1, -2], dtype=np.int32),
                "bool": np.array([True, False]),
                "empty": np.zeros((0, 3), np.uint8),
                "special": np.array([np.nan, np.inf, -0.0]),
                "zero_d": np.array(2.5),
            },
            "np_scalars": [np.int64(5), np.float32(1.5), np.bool_(True), np.float64(0.5),
                           np.str_("np")],
            "tag_lookalikes": {"t": 0, "D": [1], "f": "nan", "B": "AA==", "np": 1},
            "tensor": torch.arange(4.0),
            "set": {1, 2, 3},
            "generator": np.random.default_rng(7).bit_generator.state,  # ints > 2**64
            "count": 0,
        }

    def state_dict(self) -> dict[str, Any]:
        return self.data

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.data = sd

    def mutate(self) -> float:
        d = self.data
        d["count"] += 1
        d["arrays"]["f64"] = d["arrays"]["f64"] + random.random()
        d["floats"][5] += 1.0
        d["nested"]["list"].append(d["count"])
        d["nested"]["tuple"] = (*d["nested"]["tuple"], d["count"])
        d["bytes"] += b"x"
        d["tensor"] = d["tensor"] * 2
        d["set"].add(d["count"] + 10)
        d["int_keys"][d["count"]] = str(d["count"])
        return float(d["arrays"]["f64"].sum())


def test_user_object_with_every_leaf_type_round_trips():
    seed_all(4)
    zoo = Zoo()
    original = copy.deepcopy(zoo.state_dict())
    _check_round_trip({"user": zoo}, zoo.mutate)
    assert zoo.data["count"] == 6
    # the restore brought back exactly the containers, types and values captured
    restored_once = Zoo()
    state = TrainingState(rng=False)
    state.register("user", restored_once)
    engine = SnapshotEngine(state)
    _snapshot_at(engine, 0)
    restored_once.mutate()
    engine.restore(0)
    assert_tree_equal(restored_once.data, original)


def test_rng_streams_round_trip_alone():
    state = TrainingState()
    engine = SnapshotEngine(state)
    seed_all(5)
    _snapshot_at(engine, 0)
    first = [rng_draws() for _ in range(5)]
    engine.restore(0)
    assert [rng_draws() for _ in range(5)] == first
    assert len({tuple(d) for d in first}) == 5


def _engine_with_model(seed: int = 6):
    seed_all(seed)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = TrainingState()
    state.register("model", model)
    state.register("optim", opt)
    return SnapshotEngine(state), model, opt


def test_double_buffering_keeps_the_committed_step():
    engine, model, opt = _engine_with_model()
    train_step(model, opt)
    slot1 = engine.capture(1)
    engine.seal(slot1)
    engine.protect(1)
    step1_bytes = slot1.buffer.clone()
    step1_state = _live({"model": model, "optim": opt})

    train_step(model, opt)
    slot2 = engine.capture(2)
    assert slot2.index != slot1.index
    engine.seal(slot2)
    assert engine.held_steps() == [1, 2]
    assert torch.equal(engine.slot_for(1).buffer, step1_bytes)
    assert not torch.equal(slot2.buffer, step1_bytes)
    engine.protect(2)
    step2_state = _live({"model": model, "optim": opt})

    train_step(model, opt)
    slot3 = engine.capture(3)
    assert slot3.index == slot1.index  # step 1 is no longer committed: its slot is reused
    engine.seal(slot3)
    assert engine.held_steps() == [2, 3]
    with pytest.raises(SnapshotError, match="step 1"):
        engine.restore(1)

    engine.restore(2)
    assert_tree_equal(_live({"model": model, "optim": opt}), step2_state)
    with pytest.raises(AssertionError):
        assert_tree_equal(step2_state, step1_state)


def test_buffers_are_allocated_once_and_reused_in_steady_state():
    """Fresh allocation costs far more than a copy into existing memory: once both slots
    exist, captures of a state whose layout does not change allocate nothing."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    state = TrainingState()
    state.register("model", model)
    state.register("optim", opt)
    allocations: list[int] = []
    engine = SnapshotEngine(state, on_allocate=lambda layout: allocations.append(layout.nbytes))
    train_step(model, opt)  # Adam's moments exist from here on: the layout is final
    for step in (1, 2):
        _snapshot_at(engine, step)
    assert len(allocations) == 2, allocations  # one per slot
    buffers = {slot.index: slot.buffer.data_ptr() for slot in engine.slots}
    for step in range(3, 11):
        train_step(model, opt)
        _snapshot_at(engine, step)
        assert {slot.index: slot.buffer.data_ptr() for slot in engine.slots} == buffers
    assert len(allocations) == 2, allocations
    # A layout that changes (Adam's moments for a new parameter) reallocates, per slot.
    extra = torch.nn.Parameter(torch.randn(32, 32))
    opt.add_param_group({"params": [extra]})
    extra.grad = torch.ones_like(extra)
    opt.step()
    for step in (11, 12, 13, 14):
        _snapshot_at(engine, step)
    assert len(allocations) == 4, allocations


def test_uncommitted_step_is_overwritten_never_the_committed_one():
    engine, model, opt = _engine_with_model()
    for step in (1, 2):
        train_step(model, opt)
        engine.seal(engine.capture(step))
    engine.protect(1)  # step 2's round failed: 1 stays the committed step
    committed = engine.slot_for(1).buffer.clone()
    train_step(model, opt)
    engine.seal(engine.capture(3))
    assert engine.held_steps() == [1, 3]
    assert torch.equal(engine.slot_for(1).buffer, committed)


def test_committed_step_captured_twice_leaves_a_slot_to_write():
    """A recovery rolls back to the committed step and captures it again, so both
    slots hold it; the next capture must reuse one of them (the chaos soak found this
    as a recovery loop), and the committed step must stay restorable."""
    engine, model, opt = _engine_with_model()
    train_step(model, opt)
    engine.seal(engine.capture(1))
    engine.protect(1)
    committed = _live({"model": model, "optim": opt})
    engine.restore(1)
    engine.seal(engine.capture(1))  # the same step, in the other slot
    engine.protect(1)
    assert engine.held_steps() == [1, 1]
    train_step(model, opt)
    engine.seal(engine.capture(2))
    assert engine.held_steps() == [1, 2]
    engine.restore(1)
    assert_tree_equal(_live({"model": model, "optim": opt}), committed)


def test_replica_store_keeps_one_copy_of_a_committed_step_held_twice():
    store = ReplicaStore()
    sentinel = object()  # stands for the metadata of a complete replica
    for _ in range(2):  # the committed step is replicated again after a rollback
        slot = store.writable(0, 64)
        slot.step, slot.meta = 5, sentinel
        slot.buffer.fill_(5)
        store.protect(5)
    assert store.held_steps() == {0: [5, 5]}
    slot = store.writable(0, 64)  # was StopIteration: both slots were protected
    slot.step, slot.meta = 6, sentinel
    assert store.held_steps() == {0: [5, 6]}
    assert bool((store.get(0, 5).buffer == 5).all())


class _Interval:
    """Stands for the runtime's ``_auto_interval`` entry: a value outside the model that
    a replay may set differently, which no checksum of the replay can tell apart."""

    def __init__(self) -> None:
        self.every = 8

    def state_dict(self) -> dict[str, int]:
        return {"every": self.every}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.every = sd["every"]


def test_a_step_captured_again_after_a_deeper_rollback_restores_its_newest_copy():
    """The chaos soak's livelock: step 160 was captured with the interval 40 and its
    round failed; the job rolled back to 120, replayed, and captured 160 again with the
    interval 32, which committed. With three slots (the durable tier's zero copy) both
    copies stayed, and a rank that restored the older one skipped the next snapshot the
    others took: their rounds never met again. Every lookup takes the newest copy, and
    a later capture keeps it, not the older one."""
    seed_all(3)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    interval = _Interval()
    state = TrainingState()
    for name, obj in (("model", model), ("optim", opt), ("_auto_interval", interval)):
        state.register(name, obj)
    engine = SnapshotEngine(state, num_slots=3)
    train_step(model, opt)
    _snapshot_at(engine, 1)  # the committed step the job rolls back to
    train_step(model, opt)
    interval.every = 40
    engine.seal(engine.capture(2))  # its round fails: never committed
    engine.restore(1)
    train_step(model, opt)  # the replay: the same bits
    interval.every = 32
    engine.seal(engine.capture(2))
    engine.protect(2)
    assert engine.held_steps() == [1, 2, 2]
    engine.restore(2)
    assert interval.every == 32
    for step in (3, 4):  # the older copy of 2 is the one overwritten, never the newer
        engine.seal(engine.capture(step))
    interval.every = 0
    engine.restore(2)
    assert interval.every == 32


def test_replica_store_serves_and_keeps_the_newest_copy_of_a_step():
    store = ReplicaStore()
    # Two replicas of step 5: one from a round that failed, one received again after a
    # rollback to an earlier step (stand-ins for their metadata).
    old, new = SimpleNamespace(step=5), SimpleNamespace(step=5)
    for meta, fill in ((old, 1), (new, 2)):
        slot = store.writable(0, 64)
        slot.buffer.fill_(fill)
        store.adopt(slot, meta)
    store.protect(5)
    assert store.get(0, 5).meta is new
    store.writable(0, 64)  # takes the older copy's slot
    assert store.get(0, 5).meta is new and bool((store.get(0, 5).buffer == 2).all())


def test_failed_capture_leaves_held_snapshots_intact():
    engine, model, opt = _engine_with_model()
    bad = {"ok": 1}
    engine.state.register("user", _Dict(bad))
    train_step(model, opt)
    _snapshot_at(engine, 1)
    before = engine.slot_for(1).buffer.clone()
    bad["oops"] = object()
    train_step(model, opt)
    with pytest.raises(codec.CodecError):
        engine.capture(2)
    assert engine.held_steps() == [1]
    assert torch.equal(engine.slot_for(1).buffer, before)
    del bad["oops"]
    engine.restore(1)


class _Dict:
    def __init__(self, d: dict) -> None:
        self.d = d

    def state_dict(self) -> dict:
        return self.d

    def load_state_dict(self, sd: dict) -> None:
        self.d = sd


@pytest.mark.parametrize("segment", ["model", "optim", "rng"])
def test_corrupted_byte_fails_restore_naming_the_segment(segment):
    engine, model, opt = _engine_with_model()
    train_step(model, opt)
    slot = engine.capture(1)
    engine.seal(slot)
    engine.protect(1)
    train_step(model, opt)
    live_before = _live({"model": model, "optim": opt})
    seg = slot.layout.segment(segment)
    slot.buffer[seg.offset + 5] ^= 0x40
    with pytest.raises(checksum.ChecksumMismatch, match=rf"segment '{segment}'"):
        engine.restore(1)
    # verification happens before anything is loaded: the live state is untouched
    assert_tree_equal(_live({"model": model, "optim": opt}), live_before)
    slot.buffer[seg.offset + 5] ^= 0x40
    engine.restore(1)


@pytest.mark.parametrize(
    "dtype",
    [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64,
     torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool],
)
def test_every_supported_dtype_round_trips(dtype):
    gen = torch.Generator().manual_seed(0)
    src = (torch.randn(3, 5, generator=gen) * 50)
    if dtype.is_complex:
        src = torch.complex(src, -src)
    value = src.to(dtype)
    holder = _Dict({"t": value.clone(), "scalar": value[0, 0].clone(), "strided": value.t()})
    state = TrainingState(rng=False)
    state.register("x", holder)
    engine = SnapshotEngine(state)
    _snapshot_at(engine, 0)
    holder.d = {"t": torch.zeros(1)}
    engine.restore(0)
    assert_tree_equal(holder.d, {"t": value, "scalar": value[0, 0], "strided": value.t()})


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "torch-copy"])
@pytest.mark.parametrize("mode", ["inline", "background"])
def test_large_tensors_checksummed_during_copy_match_the_buffer(mode: str, streaming: bool):
    """Tensors above the copy/hash chunk size take the chunked path (``inline``: the
    source hashed, then copied); in either mode and either copy, the recorded digests
    must equal a fresh checksum of the finished buffer, and restore must be exact."""
    gen = torch.Generator().manual_seed(1)
    holder = _Dict({
        "small": torch.randn(7, generator=gen),
        "big": torch.randn(300_001, generator=gen),  # > 1 MiB, odd size
        "flag": torch.ones(3, dtype=torch.bool),
        "big_strided": torch.randn(600, 601, generator=gen).t(),  # > 1 MiB, not contiguous
        "big_i16": torch.randint(-999, 999, (700_000,), dtype=torch.int16, generator=gen),
        "big_2d": torch.randn(513, 1025, generator=gen),  # > 1 MiB, several dims
        "param": torch.nn.Parameter(torch.randn(262_145, generator=gen)),  # requires grad
    })
    expected = {k: v.detach().clone() for k, v in holder.d.items()}
    state = TrainingState(rng=False)
    state.register("x", holder)
    state.register("y", _Dict({"again": torch.randn(400_000, generator=gen)}))
    engine = SnapshotEngine(state, checksum=mode, streaming=streaming)
    slot = engine.capture(0)
    if mode == "inline":
        assert slot.digests is not None  # recorded by the copy itself
    meta = engine.seal(slot)
    assert meta.digests == compute_digests(slot.buffer, slot.layout, slot.skeletons)
    holder.d = {}
    engine.restore(0)
    assert_tree_equal(holder.d, expected)


def test_segment_digest_is_xxh3_of_bytes_then_skeleton_newline_layout():
    """Pins the digest definition a receiver relies on: stream the segment's chunks
    through a Hasher as they arrive, then update it with segment_trailer()."""
    engine, model, opt = _engine_with_model()
    train_step(model, opt)
    slot = engine.capture(1)
    meta = engine.seal(slot)
    for seg in meta.layout.segments:
        raw = slot.segment_bytes(seg.name).numpy().tobytes()
        specs = [[t.dtype, list(t.shape), t.offset, t.nbytes] for t in seg.tensors]
        layout_json = json.dumps([seg.nbytes, specs], separators=(",", ":")).encode()
        trailer = meta.skeletons[seg.name] + b"\n" + layout_json
        assert segment_trailer(seg, meta.skeletons[seg.name]) == trailer
        assert meta.digests[seg.name] == xxhash.xxh3_128_hexdigest(raw + trailer)
        hasher = checksum.Hasher()
        for off in range(0, seg.nbytes, 1000):
            hasher.update(slot.segment_bytes(seg.name)[off : off + 1000])
        hasher.update(trailer)
        assert hasher.hexdigest() == meta.digests[seg.name]


def test_verify_segments_checks_skeletons_of_the_named_segments_only():
    engine, model, opt = _engine_with_model()
    train_step(model, opt)
    slot = engine.capture(1)
    meta = engine.seal(slot)
    bad = dataclasses.replace(
        meta, skeletons={**meta.skeletons, "optim": meta.skeletons["optim"].replace(b"1", b"2")}
    )
    verify_segments(slot.buffer, bad, ["model", "rng"])
    with pytest.raises(checksum.ChecksumMismatch, match="segment 'optim'"):
        verify_segments(slot.buffer, bad, ["optim"])
