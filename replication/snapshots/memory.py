"""The host memory budget for snapshots, replicas and staging buffers.

Snapshot buffers are allocated once and kept for the whole run, so an over-committed
host would fail (or swap) only later, in the middle of training. We check up front,
with psutil, and refuse to start with the numbers that did not fit.

The plan counts each buffer at its own size, which is what it holds: pinned buffers
(GPU hosts) are ordinary memory page-locked in place
(:func:`replication.snapshots.slots.allocate_host`),
not blocks of torch's pinned allocator, which rounds each one up to a power of two and
keeps freed ones cached, outside any count.

The device tier (:mod:`replication.snapshots.device_tier`) does not change this plan: its slots
keep their host buffers (the seal stages the device bytes there for the side channel
and the durable tier), and its device buffers are checked against the GPU's free
memory, measured after the first step, instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from replication.config import MemoryConfig
from replication.errors import CheckpointlessError

# Extra optimizer state per parameter byte, for optimizers whose state is created
# lazily at the first step (Adam's moments do not exist before step 1).
_LAZY_STATE_FACTOR = {
    "Adam": 2.0, "AdamW": 2.0, "NAdam": 2.0, "RAdam": 2.0, "Adamax": 2.0, "Adadelta": 2.0,
    "SGD": 1.0, "Adagrad": 1.0, "RMSprop": 2.0, "ASGD": 2.0, "Rprop": 2.0,
}


class MemoryBudgetError(CheckpointlessError, RuntimeError):
    """The host cannot hold the snapshot, its replicas and staging within the budget."""


@dataclass(frozen=True)
class MemoryPlan:
    """The bytes one rank will pin down for in-memory recovery."""

    state_bytes: int
    factor: int
    staging_bytes: int  # transfer staging (GPU snapshots)
    durable_staging_bytes: int = 0  # the durable writer's copy of a snapshot being written
    # Local snapshot slots: 2 (double buffering), 3 when the durable writer persists
    # straight from a slot (it holds one while the other two keep alternating).
    local_slots: int = 2
    # The sizes of the states this rank holds replicas of, when known (from the
    # placement: with uneven nodes a rank may hold more than factor - 1, and sharded
    # states differ in size). None: factor - 1 replicas the size of this rank's state.
    replica_sizes: tuple[int, ...] | None = None

    @property
    def own_bytes(self) -> int:
        return self.local_slots * self.state_bytes

    @property
    def replica_bytes(self) -> int:
        """Double-buffered peer replicas."""
        if self.replica_sizes is not None:
            return 2 * sum(self.replica_sizes)
        return 2 * (self.factor - 1) * self.state_bytes

    def describe_replicas(self) -> str:
        if self.replica_sizes is None:
            return f"2 x {self.factor - 1} x {_fmt(self.state_bytes)} replicas"
        return (f"2 x {_fmt(sum(self.replica_sizes))} replicas "
                f"(of {len(self.replica_sizes)} peer(s))")

    @property
    def total_bytes(self) -> int:
        return self.own_bytes + self.replica_bytes + self.staging_bytes + self.durable_staging_bytes


def lazy_optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes the optimizer's state will grow to once its first step has run."""
    if optimizer.state:
        return 0
    factor = _LAZY_STATE_FACTOR.get(type(optimizer).__name__, 2.0)
    if type(optimizer).__name__ == "SGD" and not optimizer.defaults.get("momentum"):
        factor = 0.0
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return int(factor * sum(p.numel() * p.element_size() for p in params))


def host_budget_bytes(config: MemoryConfig, local_world_size: int) -> int:
    """The per-rank budget: explicit, or a share of the RAM available right now."""
    if config.host_budget_bytes > 0:
        return config.host_budget_bytes
    available = psutil.virtual_memory().available
    return int(available * config.available_fraction / max(1, local_world_size))


def _fmt(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def check_budget(
    plan: MemoryPlan, config: MemoryConfig, local_world_size: int, budget: int | None = None
) -> int:
    """Raise :class:`MemoryBudgetError` if ``plan`` exceeds the budget; return the budget.

    Pass the ``budget`` measured before any snapshot buffer existed when re-checking
    later: measuring free RAM again would count our own buffers twice.
    """
    if budget is None:
        budget = host_budget_bytes(config, local_world_size)
    if plan.total_bytes > budget:
        durable = (f" + {_fmt(plan.durable_staging_bytes)} durable-tier staging (persistence.path "
                   "is set)" if plan.durable_staging_bytes else "")
        source = (
            f"memory.host_budget_bytes={config.host_budget_bytes}"
            if config.host_budget_bytes > 0
            else f"{config.available_fraction:.0%} of available RAM "
            f"({_fmt(psutil.virtual_memory().available)}) / {local_world_size} local ranks"
        )
        raise MemoryBudgetError(
            "checkpointless cannot hold this rank's recovery state in host memory: needs "
            f"{_fmt(plan.total_bytes)} = {plan.local_slots} x {_fmt(plan.state_bytes)} snapshot "
            f"+ {plan.describe_replicas()} "
            f"+ {_fmt(plan.staging_bytes)} staging"
            f"{durable}, but the budget is {_fmt(budget)} "
            f"({source}). Lower replication.factor, raise memory.host_budget_bytes, or "
            "shard the state over more ranks."
        )
    return budget
