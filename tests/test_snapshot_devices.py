"""Snapshots of state on devices, on a CPU host: the side-stream copies, the devices a
restore puts tensors back on, and the page-locked host buffers.

The device path runs against a simulated CUDA device (:mod:`tests.sim_device`) whose
device-to-host copies land only when something synchronises with the stream they were
enqueued on, so a copy the engine does not wait for leaves its bytes missing from the
snapshot. The CUDA runtime's page-locking calls are stood in for by a stub ``cudart``.
What only a real GPU shows (real streams and events, real page-locking) is checked by
``make test-gpu``.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import pytest
import torch

from replication.snapshots import slots
from replication.snapshots.digest_copy import verify_segments
from replication.snapshots.memory import MemoryPlan
from replication.snapshots.snapshot import SnapshotEngine, restore_from_buffer
from replication.training_state import codec
from replication.training_state.layout import flatten, unflatten_segment
from replication.training_state.state import DeviceUnavailable, TrainingState
from tests.sim_device import SimDevices, SimTensor, install


class Holder:
    """A user object with a state dict (an EMA of the weights, say)."""

    def __init__(self, sd: dict[str, Any]) -> None:
        self.sd = sd

    def state_dict(self) -> dict[str, Any]:
        return self.sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.sd = sd


def _on(sim: SimDevices, index: int, values: torch.Tensor) -> SimTensor:
    return SimTensor(values, torch.device("cuda", index), sim)


def _two_device_state(sim: SimDevices) -> tuple[TrainingState, dict[str, torch.Tensor]]:
    """An EMA on both devices, a host step counter, and weights on the second device
    that an optimizer owns (copied after everything else, fenced by its step)."""
    torch.manual_seed(0)
    source = {"ema.a": torch.randn(3000), "ema.b": torch.randn(5000),
              "ema.count": torch.tensor([7]), "w": torch.randn(4000)}
    ema = Holder({"a": _on(sim, 0, source["ema.a"]), "b": _on(sim, 1, source["ema.b"]),
                  "count": source["ema.count"]})
    weight = _on(sim, 1, source["w"])
    state = TrainingState(rng=False)
    state.register("ema", ema)
    state.register("weights", Holder({"w": weight}))
    state.register("opt", torch.optim.SGD([weight], lr=0.1))
    return state, source


def _slot_values(slot: slots.SnapshotSlot) -> dict[str, torch.Tensor]:
    """The slot's tensors as they are in host memory now, keyed like the source."""
    assert slot.layout is not None
    out = {}
    for seg in slot.layout.segments:
        tree = unflatten_segment(slot.segment_bytes(seg.name), seg, slot.skeletons[seg.name])
        if seg.name == "ema":
            out.update({f"ema.{k}": v for k, v in tree.items()})
        elif seg.name == "weights":
            out["w"] = tree["w"]
    return out


def _missing(slot: slots.SnapshotSlot, source: dict[str, torch.Tensor],
             keys: list[str]) -> list[str]:
    values = _slot_values(slot)
    return [k for k in keys if not torch.equal(values[k], source[k])]


# -- one side stream per source device ---------------------------------------------------

def test_a_snapshot_of_tensors_on_two_devices_holds_every_devices_bytes(monkeypatch):
    sim = install(monkeypatch, 2)  # current device 0; half the state is on cuda:1
    state, source = _two_device_state(sim)
    engine = SnapshotEngine(state, pin_memory=False)
    slot = engine.capture(1)
    meta = engine.seal(slot)
    assert sim.in_flight() == 0, "the seal hashed while device copies were still in flight"
    assert _missing(slot, source, list(source)) == []
    assert slot.buffer is not None
    verify_segments(slot.buffer, meta)  # the checksums are of those bytes
    assert sim.foreign_records == [], "a source was recorded on another device's stream"


def test_every_devices_compute_stream_waits_for_the_copies_of_its_tensors(monkeypatch):
    sim = install(monkeypatch, 2)
    state, source = _two_device_state(sim)
    engine = SnapshotEngine(state, pin_memory=False)
    slot = engine.capture(1)
    # Before the next forward pass may change them, what is not the optimizer's has
    # been read on every device (the simulated copies land when a stream waits).
    assert _missing(slot, source, ["ema.a", "ema.b", "ema.count"]) == []
    engine.fence()  # what an optimizer step pre-hook does before the update
    assert _missing(slot, source, ["w"]) == []
    engine.seal(slot)


def test_the_side_streams_are_made_once_per_device_and_reused(monkeypatch):
    sim = install(monkeypatch, 2)
    state, _ = _two_device_state(sim)
    engine = SnapshotEngine(state, pin_memory=False)
    for step in range(3):
        engine.seal(engine.capture(step))
    assert sorted(s.device.index for s in sim.created) == [0, 1]


# -- the device of each tensor, recorded and restored ------------------------------------

def test_tensors_of_user_objects_come_back_on_the_device_they_were_captured_on(monkeypatch):
    sim = install(monkeypatch, 2)
    state, source = _two_device_state(sim)
    model = torch.nn.Linear(3, 2)
    state.register("model", model)
    weight_before = model.weight
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    asked: list[torch.device] = []

    def place(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        asked.append(device)
        return _on(sim, device.index, tensor.clone())

    state.map_location = place
    engine = SnapshotEngine(state, pin_memory=False)
    slot = engine.capture(1)
    meta = engine.seal(slot)
    with torch.no_grad():
        model.weight.add_(1.0)
    assert slot.buffer is not None
    # as from a replica or a durable checkpoint: another buffer holding the same bytes
    restore_from_buffer(state, slot.buffer.clone(), meta)

    ema = dict(state)["ema"].sd
    assert (ema["a"].device, ema["b"].device) == (torch.device("cuda", 0), torch.device("cuda", 1))
    assert torch.equal(ema["a"].inner, source["ema.a"])
    assert torch.equal(ema["b"].inner, source["ema.b"])
    assert ema["count"].device.type == "cpu" and not isinstance(ema["count"], SimTensor)
    weights = dict(state)["weights"].sd
    assert weights["w"].device == torch.device("cuda", 1)
    assert sorted(str(d) for d in asked) == ["cuda:0", "cuda:1", "cuda:1"]
    # a module still restores in place, into its own tensors
    assert model.weight is weight_before
    assert all(torch.equal(v, saved_model[k]) for k, v in model.state_dict().items())


def test_a_host_result_of_map_location_never_aliases_the_snapshot(monkeypatch):
    sim = install(monkeypatch, 2)
    state, source = _two_device_state(sim)
    state.map_location = lambda tensor, device: tensor  # "keep it on the host", carelessly
    engine = SnapshotEngine(state, pin_memory=False)
    slot = engine.capture(1)
    engine.seal(slot)
    engine.restore(1)
    assert slot.buffer is not None
    slot.buffer.fill_(0)  # the next capture into this slot
    assert torch.equal(dict(state)["ema"].sd["b"], source["ema.b"])


def test_a_recorded_device_this_process_lacks_is_refused_before_anything_loads(monkeypatch):
    sim = install(monkeypatch, 2)
    state, _ = _two_device_state(sim)
    model = torch.nn.Linear(3, 2)
    state.register("model", model)
    engine = SnapshotEngine(state, pin_memory=False)
    engine.seal(engine.capture(1))
    with torch.no_grad():
        model.weight.zero_()
    ema_before = dict(state)["ema"].sd
    # a host with one device: the default placement cannot put cuda:1 tensors back
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(DeviceUnavailable, match=r"'ema'.*cuda:1.*map_location"):
        engine.restore(1)
    assert dict(state)["ema"].sd is ema_before
    assert torch.count_nonzero(model.weight) == 0


def test_the_skeleton_records_device_tensors_and_keeps_host_tensors_as_before():
    sim = SimDevices(2)
    flat = flatten({"e": {"d": _on(sim, 1, torch.ones(2)), "h": torch.ones(2)}})
    assert codec.loads(flat.skeletons["e"]) == {
        "D": [["d", {"td": [0, "cuda:1"]}], ["h", {"t": 1}]]}
    # a host-only state encodes exactly as every earlier snapshot did
    assert flatten({"e": {"h": torch.ones(2)}}).skeletons["e"] == b'{"D":[["h",{"t":0}]]}'


@pytest.mark.parametrize("node", [
    {"td": [0]}, {"td": [0, 1]}, {"td": ["0", "cuda:1"]}, {"td": [0, "no-such-device"]},
    {"td": [5, "cuda:1"]}, {"td": 0},
])
def test_a_malformed_device_tensor_node_is_a_codec_error(node):
    with pytest.raises(codec.CodecError):
        codec.decode(node, lambda i: [torch.zeros(1)][i] if i == 0 else _raise_codec())


def _raise_codec() -> torch.Tensor:
    raise codec.CodecError("no such tensor")


# -- page-locked host buffers ----------------------------------------------------------

class StubCudart:
    """Stands in for ``torch.cuda.cudart()``: records the page-locking calls and answers
    with ``code`` (0 is cudaSuccess), as the runtime does instead of raising."""

    def __init__(self, code: int = 0) -> None:
        self.code = code
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        self.registered.append((address, nbytes, flags))
        return self.code

    def cudaHostUnregister(self, address: int) -> int:
        self.unregistered.append(address)
        return 0

    def cudaError(self, code: int) -> int:
        return code

    def cudaGetErrorString(self, code: int) -> str:
        return "out of memory" if code == 2 else "unknown"


@pytest.fixture
def cudart(monkeypatch) -> StubCudart:
    stub = StubCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: stub)
    monkeypatch.setattr(slots, "_unpinned_warned", False, raising=False)
    return stub


def test_a_pinned_buffer_locks_exactly_its_own_pages_and_unlocks_them_when_freed(cudart):
    nbytes = (5 << 20) + 4096  # torch's pinned allocator would hold 8 MiB for this
    buf = slots.allocate_host(nbytes, pin=True)
    assert buf.numel() == nbytes and torch.count_nonzero(buf) == 0
    assert cudart.registered == [(buf.data_ptr(), nbytes, 1)]
    address = buf.data_ptr()
    del buf
    gc.collect()
    assert cudart.unregistered == [address]


def test_pinned_slots_hold_what_the_memory_plan_counts(cudart):
    state = TrainingState(rng=False)
    state.register("model", torch.nn.Linear(1000, 300))
    engine = SnapshotEngine(state, pin_memory=True)
    engine.seal(engine.capture(1))
    engine.seal(engine.capture(2))
    plan = MemoryPlan(state_bytes=engine.state_bytes, factor=1, staging_bytes=0)
    assert sum(n for _, n, _ in cudart.registered) == plan.own_bytes == engine.allocated_bytes


def test_a_failed_page_lock_falls_back_to_ordinary_memory_with_one_warning(cudart, caplog):
    cudart.code = 2  # cudaErrorMemoryAllocation: too much locked memory on this host
    caplog.set_level(logging.DEBUG, logger="checkpointless.replication")
    bufs = [slots.allocate_host(1 << 20, pin=True), slots.allocate_host(1 << 20, pin=True),
            slots.allocate_shared(1 << 20, pin=True)]
    for buf in bufs:
        assert buf is not None
        buf[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        assert buf[:4].tolist() == [1, 2, 3, 4]
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(cudart.registered) == 3
    assert len(warnings) == 1 and "error 2 (out of memory)" in warnings[0].getMessage()
    del bufs, buf
    gc.collect()
    assert cudart.unregistered == [], "memory that was never locked was unlocked"


def test_no_cuda_runtime_means_ordinary_memory_with_a_warning(monkeypatch, caplog):
    def no_runtime() -> Any:
        raise AssertionError("Torch not compiled with CUDA enabled")

    monkeypatch.setattr(torch.cuda, "cudart", no_runtime)
    monkeypatch.setattr(slots, "_unpinned_warned", False, raising=False)
    with caplog.at_level(logging.WARNING, logger="checkpointless.replication"):
        buf = slots.allocate_host(4096, pin=True)
    assert buf.numel() == 4096 and torch.count_nonzero(buf) == 0
    assert "no CUDA runtime" in caplog.text


def test_a_failed_page_lock_of_a_shared_buffer_is_reported_and_never_undone(cudart, caplog):
    cudart.code = 2
    with caplog.at_level(logging.WARNING, logger="checkpointless.replication"):
        buf = slots.allocate_shared(1 << 20, pin=True)
    assert buf is not None and slots.shared_location(buf) is not None
    assert len(cudart.registered) == 1 and "out of memory" in caplog.text
    del buf
    gc.collect()
    assert cudart.unregistered == []


def test_a_durable_checkpoint_names_device_tensors_by_their_path(monkeypatch):
    """The durable tier's DCP keys come from the skeleton: a device tensor is named
    ``ema.b`` like a host one, not by the ``#<index>`` fallback."""
    from replication.durable.format import tensor_keys

    sim = install(monkeypatch, 2)
    state, _ = _two_device_state(sim)
    engine = SnapshotEngine(state, pin_memory=False)
    meta = engine.seal(engine.capture(1))
    keys = tensor_keys(meta)
    assert sorted(keys["ema"]) == ["ema.a", "ema.b", "ema.count"]
    assert keys["weights"] == ["weights.w"]
