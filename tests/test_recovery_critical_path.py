"""What lies on a recovery's critical path, taken off it or made cheaper, checked piece
by piece in-process (the jobs in ``test_live_rollback.py`` and ``test_owned_group.py``
run the same code end to end, bit-identical to runs without failures):

- a survivor captures its live step while the rendezvous waits for the newcomers, and
  never into a slot a plan could need; a plan that does not use the capture leaves
  nothing of it behind;
- ``all_reduce_gradients`` flattens into one buffer kept from step to step;
- a replacement's DDP constructor skips the weight broadcast that completes locally.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from recovery.generation.rendezvous import GenerationChanged, RecoveryPlan
from recovery.process_group import init_hook
from recovery.process_group.controller import controller
from recovery.process_group.owned_group import ElasticProcessGroup
from recovery.runtime import gradient_average, live_rollback
from replication.replica_protocol.marks import MarkBook
from replication.snapshots.snapshot import SnapshotEngine
from replication.training_state.state import TrainingState

# -- the survivor's capture ahead of the plan ------------------------------------------------


class _Interval:
    """The snapshot interval in force, part of the state as with ``every_n_steps: auto``
    (``recovery.schedules.auto_interval``): a small entry, so each step's mark holds it."""

    def __init__(self, every: int) -> None:
        self.every = every

    def state_dict(self) -> dict[str, int]:
        return {"every": self.every}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.every = int(sd["every"])


class _Job:
    """A data-parallel job's state, engine and marks: step 8 snapshotted and committed,
    step 9 trained and marked, then the failed step 10 drew from the RNG and ran its
    forward and backward. ``every_at_mark``: the snapshot interval when step 9 was
    marked; an agreement at step 9's end then made it 1000 (by default it was 1000
    already: step 9 is not a snapshot the schedule takes)."""

    def __init__(self, every_at_mark: int = 1000) -> None:
        torch.manual_seed(0)
        self.interval = _Interval(every_at_mark)
        self.noted: list[int] = []  # before_capture's steps
        self.model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=1, gamma=0.9)
        self.state = TrainingState()
        for name, obj in (("model", self.model), ("optimizer", self.opt),
                          ("scheduler", self.sched), ("_interval", self.interval)):
            self.state.register(name, obj)
        self.engine = SnapshotEngine(self.state)
        self.book = MarkBook(self.state)
        self.book.declare({"model"})
        self.excluded: list[int] = []
        self._train()
        self.engine.seal(self.engine.capture(8))
        self.engine.protect(8)
        self.committed_digests = dict(self.engine.slot_for(8).digests or {})
        self._train()
        self.book.capture(9)
        self.expected = self._snapshot_of_9()
        self.interval.every = 1000  # the agreement at step 9's end, after its mark
        torch.rand(50)  # the failed step 10's draws: the mark puts the RNG back
        self.model(torch.randn(4, 16)).sum().backward()
        assert self.book.live_step() == 9

    def _train(self) -> None:
        self.model(torch.randn(4, 16)).sum().backward()
        self.opt.step()
        self.opt.zero_grad()
        self.sched.step()

    def _snapshot_of_9(self) -> dict[str, str]:
        """The digests a capture of step 9 has, taken on a copy of the engine's state."""
        other = SnapshotEngine(self.state)
        slot = other.capture(9)
        other.seal(slot)
        return dict(slot.digests or {})

    def runtime(self) -> Any:
        """The runtime's parts the capture uses (its replicator and durable tier)."""
        rep = types.SimpleNamespace(engine=self.engine, marks=self.book,
                                    capture=self.engine.capture,
                                    snapshot_due=lambda step: step % self.interval.every == 0)
        durable = types.SimpleNamespace(exclude=self.excluded.append,
                                        include=self.excluded.remove,
                                        before_capture=self.noted.append)
        return types.SimpleNamespace(replicator=rep, durable=durable)

    def slot_steps(self) -> list[int]:
        return sorted(s.step for s in self.engine.slots)


@pytest.fixture
def job(monkeypatch) -> _Job:
    job = _Job()
    monkeypatch.setattr(live_rollback, "_replicator", lambda rt: rt.replicator)
    return job


def _plan(live: bool, target: int) -> tuple[RecoveryPlan, None]:
    return RecoveryPlan(gen=1, target_step=target, providers={1: 0}, planner=0, live=live,
                        base_step=8), None


def test_a_live_plan_gets_the_capture_taken_while_it_was_being_made(job):
    rt = job.runtime()
    live_rollback.rendezvous_capturing_ahead(rt, 9, lambda: _plan(True, 9))
    ahead = live_rollback._AHEAD.pop(job.engine)
    slot = ahead.result()
    assert slot.step == 9 and dict(slot.digests or {}) == job.expected  # the mark's step 9
    assert job.excluded == [9]  # not a durable save: a run without failures has none
    assert job.engine.slot_for(8).digests == job.committed_digests  # kept


def test_the_schedule_decides_by_the_interval_in_force_at_the_live_step(monkeypatch):
    """Step 9 was a snapshot the schedule takes when it was marked (every 3 steps); the
    agreement at its end changed the interval. The capture ahead decides after loading
    the mark, as the replacement does after loading its own: step 9 is an ordinary
    snapshot on every rank, not excluded from the durable saves on the survivors only."""
    job = _Job(every_at_mark=3)
    monkeypatch.setattr(live_rollback, "_replicator", lambda rt: rt.replicator)
    live_rollback.rendezvous_capturing_ahead(job.runtime(), 9, lambda: _plan(True, 9))
    live_rollback._AHEAD.pop(job.engine).result()
    assert job.interval.every == 3  # the mark's
    assert job.noted == [9] and job.excluded == []


@pytest.mark.parametrize("outcome", ["snapshot plan", "another step", "rendezvous failed"])
def test_a_plan_that_does_not_use_it_leaves_nothing_of_it(job, outcome):
    rt = job.runtime()

    def agree():
        if outcome == "rendezvous failed":
            raise GenerationChanged("a second failure")
        return _plan(False, 8) if outcome == "snapshot plan" else _plan(True, 7)

    if outcome == "rendezvous failed":
        with pytest.raises(GenerationChanged):
            live_rollback.rendezvous_capturing_ahead(rt, 9, agree)
    else:
        live_rollback.rendezvous_capturing_ahead(rt, 9, agree)
    assert job.engine not in live_rollback._AHEAD
    assert 9 not in job.slot_steps()  # freed: no snapshot of a step the job rolls back past
    # Step 9 is a durable save again if the schedule makes it one when it is run again
    # (the capture had excluded it; a rank that kept it out alone would leave that
    # checkpoint incomplete).
    assert job.excluded == []
    assert job.engine.slot_for(8).digests == job.committed_digests


def test_no_capture_ahead_while_a_snapshot_newer_than_the_committed_one_is_held(job):
    """Then the plan decides which slot is free (the newer one may be what it commits
    to), so the survivor captures after the plan, as before."""
    job.engine.seal(job.engine.capture(9))  # step 9's own snapshot, its round unfinished
    before = job.slot_steps()
    seen: list[list[int]] = []
    live_rollback.rendezvous_capturing_ahead(job.runtime(), 9,
                                             lambda: (seen.append(job.slot_steps()),
                                                      _plan(True, 9))[1])
    assert job.engine not in live_rollback._AHEAD
    assert seen == [before] and job.slot_steps() == before


def test_no_capture_ahead_without_a_live_step(job):
    live_rollback.rendezvous_capturing_ahead(job.runtime(), -1, lambda: _plan(False, 8))
    assert job.engine not in live_rollback._AHEAD and job.excluded == []


# -- all_reduce_gradients' flat buffer ------------------------------------------------------


def test_gradients_are_flattened_into_one_buffer_kept_from_step_to_step():
    model = torch.nn.Linear(8, 4)
    grads = [torch.randn(4, 8), torch.randn(4)]
    first = gradient_average.flat_gradients(model, grads)
    assert torch.equal(first, torch._utils._flatten_dense_tensors(grads))
    grads = [torch.randn(4, 8), torch.randn(4)]
    second = gradient_average.flat_gradients(model, grads)
    assert second.data_ptr() == first.data_ptr()  # the same memory, no new pages
    assert torch.equal(second, torch._utils._flatten_dense_tensors(grads))
    fewer = gradient_average.flat_gradients(model, grads[:1])  # a parameter without grad
    assert fewer.numel() == 32 and torch.equal(fewer, grads[0].reshape(-1))
    mixed = [torch.randn(3), torch.randn(2, dtype=torch.float64)]
    assert torch.equal(gradient_average.flat_gradients(model, mixed),
                       torch._utils._flatten_dense_tensors(mixed))


# -- a replacement's DDP constructor -------------------------------------------------------


def test_the_weight_broadcast_of_a_replacement_not_yet_joined_is_skipped(monkeypatch):
    """DDP's constructor calls ``_sync_params_and_buffers``; before the replacement
    joined, the broadcast inside completes locally, so the flatten and copies around it
    are skipped (counted as one local collective). Any other group runs it."""
    import torch.distributed.utils as dist_utils

    calls: list[Any] = []
    monkeypatch.setattr(dist_utils, "_sync_params_and_buffers",
                        lambda group, *args, **kw: calls.append(group))
    init_hook._install_module_sync_hook()
    hooked = dist_utils._sync_params_and_buffers
    group = ElasticProcessGroup(controller(), 1, 2, [0, 1], "test-sync-hook")
    tensors = [torch.randn(3), torch.randn(2)]
    before = [t.clone() for t in tensors]
    counted = controller().local_collectives
    assert group.completes_locally()
    hooked(group, tensors, 1 << 20, 0)
    assert calls == [] and controller().local_collectives == counted + 1
    assert all(torch.equal(a, b) for a, b in zip(tensors, before, strict=True))
    other = object()
    hooked(other, tensors, 1 << 20, 0)
    assert calls == [other]
