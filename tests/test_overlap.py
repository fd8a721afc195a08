"""Overlapped captures (ADR 0013): the large tensors only ``optimizer.step()`` changes are
copied after ``capture`` returns, and every way of changing them waits for that copy.

Single process. The multi-process runs (tests/test_replication.py, the chaos tests)
use the replicator's default, which overlaps, and check bit-identity end to end.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
from typing import Any

import pytest
import torch

from replication.config import ReplicationConfig
from replication.snapshots.digest_copy import compute_digests
from replication.snapshots.overlap import COPY_NICE, DEFER_MIN_BYTES, SnapshotTorn, run_niced
from replication.snapshots.snapshot import SnapshotEngine
from replication.training_state.state import TrainingState
from tests.helpers.training import assert_tree_equal


class Net(torch.nn.Module):
    """Large weights (deferred), a small bias and batch-norm buffers (copied at once)."""

    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Linear(256, 256)  # 256 KiB of weight
        self.norm = torch.nn.BatchNorm1d(256)
        self.head = torch.nn.Linear(256, 4)  # 4 KiB: below DEFER_MIN_BYTES

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.big(x)))


def _trained(opt_cls: type = torch.optim.Adam) -> tuple[Net, Any, torch.Tensor]:
    """A model and optimizer after one step (the optimizer state exists), and a batch."""
    torch.manual_seed(0)
    model = Net()
    opt = opt_cls(model.parameters(), lr=0.01)
    batch = torch.randn(8, 256)
    _step(model, opt, batch)
    return model, opt, batch


def _setup(
    opt_cls: type = torch.optim.Adam, **engine_kwargs: Any
) -> tuple[SnapshotEngine, Net, Any, torch.Tensor]:
    model, opt, batch = _trained(opt_cls)
    state = TrainingState(rng=False)
    state.register("model", model)
    state.register("optim", opt)
    return SnapshotEngine(state, overlap=True, **engine_kwargs), model, opt, batch


def _step(model: Net, opt: Any, batch: torch.Tensor) -> None:
    opt.zero_grad()
    model(batch).pow(2).mean().backward()
    opt.step()


def _live(model: Net, opt: Any) -> dict[str, Any]:
    return copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})


def _restored(engine: SnapshotEngine, step: int, model: Net, opt: Any) -> dict[str, Any]:
    engine.restore(step)
    return _live(model, opt)


def test_capture_defers_only_large_optimizer_owned_tensors():
    engine, model, opt, _ = _setup()
    slot = engine.capture(1)
    pending = engine.pending
    assert pending is not None and slot.pending is pending
    deferred = {t.data_ptr() for _, t, _ in pending._watched}
    big = [model.big.weight, *opt.state[model.big.weight].values()]
    assert deferred == {t.data_ptr() for t in big if t.numel() * t.element_size()
                        >= DEFER_MIN_BYTES}
    assert len(deferred) == 3  # the weight and Adam's two moments
    assert pending.nbytes == 3 * 256 * 256 * 4
    # Everything else is in the slot already (buffers, small tensors, Adam's step).
    assert slot.digests is None and not engine.held_steps()


def test_copy_on_another_thread_overlaps_the_next_forward_and_backward():
    engine, model, opt, batch = _setup()
    expected = _live(model, opt)
    slot = engine.capture(1)
    sealed: list[Any] = []
    sealer = threading.Thread(target=lambda: sealed.append(engine.seal(slot)))
    sealer.start()
    _step(model, opt, batch)  # forward/backward run alongside; the step's hook fences
    sealer.join()
    meta = sealed[0]
    assert meta.digests == compute_digests(slot.buffer, slot.layout, slot.skeletons)
    assert engine.pending is None
    assert_tree_equal(_restored(engine, 1, model, opt), expected)


def test_optimizer_step_copies_a_pending_snapshot_before_updating():
    """No round ever sealed the slot: the step's pre-hook does the copy itself."""
    engine, model, opt, batch = _setup()
    expected = _live(model, opt)
    slot = engine.capture(1)
    waited = engine.fence_wait_s
    _step(model, opt, batch)
    assert engine.pending is None and engine.fence_wait_s > waited
    assert slot.pending is not None and slot.pending.done.is_set()
    engine.seal(slot)  # only hands over the digests now
    after = _live(model, opt)
    assert_tree_equal(_restored(engine, 1, model, opt), expected)
    with pytest.raises(AssertionError):
        assert_tree_equal(after, expected)  # the step did change the weights


@pytest.mark.parametrize("positional", [False, True])
def test_a_closure_step_fences_after_the_closure_and_before_the_update(positional: bool):
    """Lightning passes the forward/backward as a closure: the copy overlaps it."""
    engine, model, opt, batch = _setup(torch.optim.SGD)
    expected = _live(model, opt)
    engine.capture(1)
    seen_pending: list[bool] = []

    def closure() -> torch.Tensor:
        seen_pending.append(engine.pending is not None)
        opt.zero_grad()
        loss = model(batch).pow(2).mean()
        loss.backward()
        return loss

    if positional:
        opt.step(closure)
    else:
        opt.step(closure=closure)
    assert seen_pending == [True]  # not fenced before the closure ran
    assert engine.pending is None  # fenced before the update
    engine.seal(engine.slots[0] if engine.slots[0].step == 1 else engine.slots[1])
    assert_tree_equal(_restored(engine, 1, model, opt), expected)


def test_batch_norm_statistics_updated_by_forward_are_not_torn():
    """Buffers change in the forward pass, so they are copied at capture."""
    engine, model, opt, batch = _setup()
    expected = _live(model, opt)
    slot = engine.capture(1)
    model(batch)  # updates running_mean / running_var in place
    engine.seal(slot)
    assert_tree_equal(_restored(engine, 1, model, opt), expected)


def test_a_weight_changed_during_the_copy_makes_a_torn_snapshot_and_turns_overlap_off(caplog):
    engine, model, opt, batch = _setup()
    slot = engine.capture(1)
    with torch.no_grad():
        model.big.weight.add_(1.0)  # outside optimizer.step(), before any copy
    torn = r"state entry 'model', tensor #\d+ \(float32\[256, 256\]\)"
    with pytest.raises(SnapshotTorn, match=torn):
        engine.seal(slot)
    assert engine.held_steps() == []  # never sealed: a round would not commit it
    with caplog.at_level(logging.WARNING, logger="checkpointless.replication"):
        engine.fence()
    assert not engine.overlap and "overlap_copy=false" in caplog.text
    expected = _live(model, opt)
    slot = engine.capture(2)  # a blocking capture from now on
    assert slot.pending is None and engine.pending is None
    engine.seal(slot)
    _step(model, opt, batch)
    assert_tree_equal(_restored(engine, 2, model, opt), expected)


def test_a_change_outside_the_optimizer_after_the_copy_turns_overlap_off(caplog):
    """The snapshot is intact (copied first), but the loop is unsafe for overlap."""
    engine, model, opt, batch = _setup()
    expected = _live(model, opt)
    slot = engine.capture(1)
    engine.seal(slot)
    with torch.no_grad():
        model.big.weight.mul_(2.0)
    with caplog.at_level(logging.WARNING, logger="checkpointless.replication"):
        _step(model, opt, batch)
    assert not engine.overlap
    assert "changed in place between the capture of step 1" in caplog.text
    assert_tree_equal(_restored(engine, 1, model, opt), expected)


def test_a_restore_waits_for_the_pending_copy_of_a_newer_snapshot():
    engine, model, opt, batch = _setup()
    engine.seal(engine.capture(1))
    engine.protect(1)
    _step(model, opt, batch)
    expected2 = _live(model, opt)
    slot2 = engine.capture(2)  # pending; the restore below writes the same tensors
    engine.restore(1)
    assert slot2.pending is not None and slot2.pending.done.is_set()
    engine.seal(slot2)
    assert_tree_equal(_restored(engine, 2, model, opt), expected2)


def test_the_engine_keeps_no_hook_alive_and_the_replicator_overlaps_by_default():
    engine, model, opt, batch = _setup()
    engine.seal(engine.capture(1))
    assert len(opt._optimizer_step_pre_hooks) == 1
    engine.capture(2)
    engine.fence()
    engine.capture(3)
    assert len(opt._optimizer_step_pre_hooks) == 1  # hooked once per optimizer
    del engine
    _step(model, opt, batch)  # a dead engine's hook does nothing
    assert ReplicationConfig().overlap_copy is True


def test_a_round_does_the_copy_on_a_thread_at_the_lowest_priority():
    seen: list[tuple[int, int]] = []

    def probe() -> None:
        tid = threading.get_native_id()
        seen.append((tid, os.getpriority(os.PRIO_PROCESS, tid)))

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    run_niced(probe)
    assert seen and seen[0][0] != threading.get_native_id()
    assert seen[0][1] == COPY_NICE
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before

    engine, model, opt, batch = _setup()
    expected = _live(model, opt)
    slot = engine.capture(1)
    meta = engine.seal(slot, low_priority=True)
    assert meta.digests == compute_digests(slot.buffer, slot.layout, slot.skeletons)
    _step(model, opt, batch)
    assert_tree_equal(_restored(engine, 1, model, opt), expected)


def test_overlap_min_bytes_zero_defers_every_optimizer_owned_tensor():
    engine, model, opt, batch = _setup(overlap_min_bytes=0)
    expected = _live(model, opt)
    slot = engine.capture(1)
    assert slot.pending is not None
    params = list(model.parameters())
    owned = params + [v for p in params for v in opt.state[p].values()]  # Adam's step too
    assert {t.data_ptr() for _, t, _ in slot.pending._watched} == {t.data_ptr() for t in owned}
    _step(model, opt, batch)
    engine.seal(slot)
    assert_tree_equal(_restored(engine, 1, model, opt), expected)


class _Checkpoint:
    """A framework-style entry: a checkpoint dictionary built from live objects."""

    def __init__(self, model: Net, opt: Any) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["optim"])


def test_declared_optimizers_own_tensors_reached_through_other_entries():
    model, opt, batch = _trained()
    state = TrainingState(rng=False)
    state.register("ckpt", _Checkpoint(model, opt))
    engine = SnapshotEngine(state, overlap=True)
    engine.seal(engine.capture(1))
    assert engine.slots[0].pending is None and not opt._optimizer_step_pre_hooks
    state.declare_optimizers([opt])
    assert state.optimizers() == [opt]
    expected = _live(model, opt)
    slot = engine.capture(2)
    assert slot.pending is not None and slot.pending.nbytes == 3 * 256 * 256 * 4
    _step(model, opt, batch)  # the declared optimizer's hook fences the copy
    engine.seal(slot)
    engine.restore(2)
    assert_tree_equal(_live(model, opt), expected)


def test_a_slot_reused_after_an_unsealed_overlapped_capture_gets_fresh_digests():
    """A round abandoned before sealing leaves its PendingCopy on the slot; the next
    capture into that slot must not hand out the old copy's digests."""
    engine, model, opt, batch = _setup()
    engine.capture(1)  # its round never runs
    _step(model, opt, batch)  # the fence copies it
    engine.overlap = False
    engine.seal(engine.capture(2))
    engine.protect(2)
    _step(model, opt, batch)
    expected = _live(model, opt)
    slot = engine.capture(3)  # reuses step 1's slot
    meta = engine.seal(slot)
    assert meta.digests == compute_digests(slot.buffer, slot.layout, slot.skeletons)
    assert_tree_equal(_restored(engine, 3, model, opt), expected)


def test_a_fence_takes_the_copy_over_from_a_starved_background_thread():
    """The low-priority copier gives the copy up at its next chunk boundary once the
    training thread needs it; the training thread does the rest itself."""
    engine, model, opt, batch = _setup()
    expected = _live(model, opt)
    slot = engine.capture(1)
    pending = slot.pending
    assert pending is not None and pending._steps is not None
    inner, workers = pending._steps, []
    in_first_chunk, release = threading.Event(), threading.Event()

    def traced():  # records which thread copies each piece; the first one stalls
        while True:
            workers.append(threading.get_ident())
            if len(workers) == 1:
                in_first_chunk.set()
                release.wait()  # a starved thread: no CPU until released
            try:
                next(inner)
            except StopIteration as finished:
                return finished.value
            yield

    pending._steps = traced()
    copier = threading.Thread(target=pending.run, kwargs={"background": True})
    copier.start()
    assert in_first_chunk.wait(10)

    def release_once_the_fence_asks() -> None:
        # Released when the training thread is waiting at the fence, not after a fixed
        # delay: on a loaded host the step reached the fence after a 0.2 s timer had
        # already let the copier finish everything.
        pending._wanted.wait(30)
        release.set()

    threading.Thread(target=release_once_the_fence_asks, daemon=True).start()
    _step(model, opt, batch)  # the fence: waits for that one piece, then takes over
    copier.join(10)
    assert pending.done.is_set() and not copier.is_alive()
    me = threading.get_ident()
    assert workers[0] == copier.ident and workers[-1] == me
    assert workers.count(copier.ident) == 1, "the copier went on after the fence asked"
    engine.seal(slot)
    assert_tree_equal(_restored(engine, 1, model, opt), expected)


def test_a_round_abandoned_before_sealing_cannot_finish_a_reused_slot(monkeypatch):
    """Recovery abandons a round; the fence finishes its copy; the slot is captured
    again. When the old round thread gets to the end of seal(), it must fail instead of
    stamping its step's digests on the new snapshot (found in review)."""
    engine, model, opt, batch = _setup()
    go = threading.Event()
    monkeypatch.setattr("replication.snapshots.overlap.run_niced", lambda fn: go.wait(10))
    slot = engine.capture(1)
    errors: list[BaseException] = []

    def old_round() -> None:
        try:
            engine.seal(slot, low_priority=True)
        except BaseException as exc:
            errors.append(exc)

    stale = threading.Thread(target=old_round)
    stale.start()  # parked in run_niced, as a starved round thread would be
    engine.fence()  # the restore guard of a recovery: finishes the copy
    engine.seal(engine.capture(2))
    engine.protect(2)
    _step(model, opt, batch)
    expected = _live(model, opt)
    again = engine.capture(3)
    assert again is slot  # step 1's slot, reused
    go.set()
    stale.join(10)
    assert len(errors) == 1 and "reused before its round sealed it" in str(errors[0])
    meta = engine.seal(again)
    assert meta.step == 3
    assert meta.digests == compute_digests(again.buffer, again.layout, again.skeletons)
    assert_tree_equal(_restored(engine, 3, model, opt), expected)
