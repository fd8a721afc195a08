"""The host memory budget: the plan's arithmetic, the refusal message, and the
pre-start check of a real Replicator (including optimizer state created lazily)."""

from __future__ import annotations

import psutil
import pytest
import torch
import torch.distributed as dist

from replication.config import MemoryConfig, ReplicationConfig
from replication.replica_protocol.replicator import Replicator
from replication.snapshots.memory import (
    MemoryBudgetError,
    MemoryPlan,
    check_budget,
    host_budget_bytes,
    lazy_optimizer_bytes,
)
from replication.training_state.layout import flatten
from replication.training_state.state import TrainingState
from tests.helpers.mp import free_port, run_workers
from tests.helpers.training import Holder

MiB = 1 << 20


@pytest.mark.parametrize(
    ("state", "factor", "staging", "total"),
    [(MiB, 1, 0, 2 * MiB), (MiB, 2, 0, 4 * MiB), (MiB, 3, 5, 6 * MiB + 5), (7, 4, 0, 56)],
)
def test_plan_counts_double_buffered_own_and_replica_copies(state, factor, staging, total):
    plan = MemoryPlan(state_bytes=state, factor=factor, staging_bytes=staging)
    assert plan.own_bytes == 2 * state
    assert plan.replica_bytes == 2 * (factor - 1) * state
    assert plan.total_bytes == total


def test_refusal_message_gives_needed_bytes_and_budget():
    plan = MemoryPlan(state_bytes=MiB, factor=2, staging_bytes=0)
    with pytest.raises(MemoryBudgetError) as info:
        check_budget(plan, MemoryConfig(host_budget_bytes=1000), 1)
    msg = str(info.value)
    assert "needs 4.0 MiB" in msg
    assert "2 x 1.0 MiB snapshot" in msg and "2 x 1 x 1.0 MiB replicas" in msg
    assert "budget is 1000 B" in msg
    assert "memory.host_budget_bytes=1000" in msg
    assert "replication.factor" in msg  # says what to change


def test_durable_staging_copy_is_counted_and_named():
    plan = MemoryPlan(state_bytes=MiB, factor=2, staging_bytes=0, durable_staging_bytes=MiB)
    assert plan.total_bytes == 5 * MiB
    assert check_budget(plan, MemoryConfig(host_budget_bytes=5 * MiB), 1) == 5 * MiB
    with pytest.raises(MemoryBudgetError) as info:
        check_budget(plan, MemoryConfig(host_budget_bytes=5 * MiB - 1), 1)
    msg = str(info.value)
    assert "needs 5.0 MiB" in msg and "1.0 MiB durable-tier staging" in msg, msg


def test_budget_boundary_is_inclusive():
    plan = MemoryPlan(state_bytes=1000, factor=2, staging_bytes=24)
    assert check_budget(plan, MemoryConfig(host_budget_bytes=4024), 4) == 4024
    with pytest.raises(MemoryBudgetError):
        check_budget(plan, MemoryConfig(host_budget_bytes=4023), 4)


def test_default_budget_is_a_share_of_available_ram():
    total = psutil.virtual_memory().total
    budget = host_budget_bytes(MemoryConfig(available_fraction=0.5), local_world_size=4)
    assert 0 < budget <= total * 0.5 / 4
    huge = MemoryPlan(state_bytes=total, factor=2, staging_bytes=0)
    with pytest.raises(MemoryBudgetError, match=r"50% of available RAM .* / 4 local ranks"):
        check_budget(huge, MemoryConfig(available_fraction=0.5), 4)


def _replicator(state: TrainingState, budget: int, factor: int = 1) -> Replicator:
    return Replicator(
        state,
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        node=0,
        config=ReplicationConfig(factor=factor, timeout_s=10),
        memory=MemoryConfig(host_budget_bytes=budget),
    )


def _state(optimizer: str) -> tuple[TrainingState, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)  # 4 MiB of parameters
    opt = {
        "adam": lambda: torch.optim.Adam(model.parameters()),
        "sgd": lambda: torch.optim.SGD(model.parameters(), lr=0.1),
        "sgd-momentum": lambda: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
    }[optimizer]()
    state = TrainingState()
    state.register("model", model)
    state.register("optim", opt)
    return state, model


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_replicator_refuses_to_start_when_the_state_does_not_fit():
    state, _ = _state("adam")
    with pytest.raises(MemoryBudgetError, match=r"needs \d+\.\d MiB.*budget is 1000 B"):
        _replicator(state, budget=1000)


def test_lazy_optimizer_bytes():
    for name, factor in (("adam", 2), ("sgd", 0), ("sgd-momentum", 1)):
        state, model = _state(name)
        opt = dict(iter(state))["optim"]
        assert lazy_optimizer_bytes(opt) == factor * _param_bytes(model), name
        model(torch.randn(2, 1024)).sum().backward()
        opt.step()
        assert lazy_optimizer_bytes(opt) == 0, name  # the state exists now


def test_pre_start_check_counts_adam_moments_before_the_first_step():
    state, model = _state("adam")
    now = flatten(state.capture()).nbytes  # Adam has no state yet
    params = _param_bytes(model)
    # enough for the state as it is now, not for the moments the first step creates
    budget = 2 * now + params
    with pytest.raises(MemoryBudgetError):
        _replicator(state, budget)

    sgd_state, _ = _state("sgd")  # no lazy state: the same budget is enough
    assert flatten(sgd_state.capture()).nbytes == now
    rep = _replicator(sgd_state, budget)
    rep.close()

    # the estimate matches what the first step really adds
    model(torch.randn(2, 1024)).sum().backward()
    dict(iter(state))["optim"].step()
    after = flatten(state.capture()).nbytes
    assert abs(after - (now + 2 * params)) < 0.01 * after


def test_snapshot_refuses_to_grow_past_the_budget_and_keeps_the_committed_step():
    holder = Holder({"x": torch.zeros(64 * 1024)})  # 256 KiB
    state = TrainingState(rng=False)
    state.register("user", holder)
    size = flatten(state.capture()).nbytes
    rep = _replicator(state, budget=3 * size)
    try:
        rep.snapshot(1)
        rep.wait()
        assert rep.committed_step() == 1
        holder.sd = {"x": torch.ones(4 * 64 * 1024)}  # the state quadruples
        with pytest.raises(MemoryBudgetError, match="budget is"):
            rep.snapshot(2)
        assert rep.engine.held_steps() == [1]
        rep.restore_local(1)
        assert torch.equal(holder.sd["x"], torch.zeros(64 * 1024))
    finally:
        rep.close()


def test_budget_counts_the_replicas_a_rank_actually_holds(tmp_path):
    """Nodes of uneven size: with k=2, ranks 0 and 1 (node 0) both keep their replica on
    rank 2 (node 1), which holds two replicas where k - 1 = 1 would suggest one. A budget
    of 5 states fits 2 local slots + 2 x 1 replica (4 states), not 2 + 2 x 2 (6): rank 2
    must refuse and say what it holds, the others start."""
    run = run_workers("tests.workers.budget_worker", 3,
                      {"port": free_port(), "nodes": [0, 0, 1], "factor": 2,
                       "budget_states": 5}, tmp_path, timeout_s=60)
    assert not run.timed_out and set(run.results) == {0, 1, 2}, run.describe()
    assert run.results[0] == {**run.results[0], "refused": None, "replicas_held": 1}
    assert run.results[1] == {**run.results[1], "refused": None, "replicas_held": 0}
    refused = run.results[2]["refused"]
    assert refused is not None, run.results[2]
    assert "replicas (of 2 peer(s))" in refused and "budget is" in refused, refused
