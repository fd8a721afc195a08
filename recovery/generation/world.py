"""The job's world: which launch ranks train now, and which ranks' data each one takes.

A job starts with every launch rank training (``WORLD_SIZE`` of them, the *configured*
world). When a lost node's ranks have no spare node to go to and
``recovery.on_no_spare`` is ``shrink`` (ADR 0035), an agent retires that node's group and
publishes a new world: the remaining launch ranks, renumbered ``0..M-1`` in launch
order, each also taking the data of some retired ranks (its *virtual* ranks), so the
global batch and the sample order stay the configured world's.

A world record is sealed and versioned: ``cl/world/{v}`` holds the world in effect for
every generation after ``after_gen``, and ``cl/world/versions`` counts the records. A
worker of generation ``G`` takes the newest record with ``after_gen < G`` (none: the
launch world). The agent writes the record before it declares the generation that
applies it, so every rank of that generation reads the same world.

A process keeps its *slot* (its launch rank: heartbeat files, owner records and ``done``
records are the agents' and name slots) in ``CHECKPOINTLESS_INTERNAL_SLOT`` and gets its
training rank in the current world as ``RANK``/``WORLD_SIZE``
(:func:`apply_to_environ`).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass

import torch.distributed as dist

from recovery.generation import protocol
from recovery.job_store import auth
from replication.contract import INTERNAL_PREFIX
from replication.errors import CheckpointlessError

ENV_SLOT = f"{INTERNAL_PREFIX}SLOT"  # this process's launch rank
ENV_CONFIGURED_WORLD = f"{INTERNAL_PREFIX}CONFIGURED_WORLD"  # the launch WORLD_SIZE
#: The owner record's node of a retired group (see :func:`launcher.membership.take_over`).
RETIRED = -1

_VERSIONS = f"{protocol.PREFIX}/world/versions"
_RESIZABLE = f"{protocol.PREFIX}/world/resizable"


def _key(version: int) -> str:
    return f"{protocol.PREFIX}/world/{version}"


@dataclass(frozen=True)
class World:
    """One world: ``slots`` are the launch ranks that train, in training-rank order."""

    configured: int  # the launch world size: how the data is split
    slots: tuple[int, ...]
    after_gen: int = -1
    version: int = 0

    @staticmethod
    def launch(configured: int) -> World:
        return World(configured, tuple(range(configured)))

    @property
    def size(self) -> int:
        return len(self.slots)

    @functools.cached_property
    def resized(self) -> bool:  # cached: a step (all_reduce_gradients) asks
        return self.slots != tuple(range(self.configured))

    @functools.cached_property
    def hosted_counts(self) -> tuple[int, ...]:
        """How many configured ranks' batches each training rank takes."""
        return tuple(len(self.hosted(r)) for r in range(self.size))

    @functools.cached_property
    def uneven(self) -> bool:
        """Whether ranks take different numbers of configured ranks' batches."""
        return len(set(self.hosted_counts)) > 1

    @property
    def retired(self) -> tuple[int, ...]:
        return tuple(sorted(set(range(self.configured)) - set(self.slots)))

    def rank_of(self, slot: int) -> int | None:
        return self.slots.index(slot) if slot in self.slots else None

    def hosted(self, rank: int) -> tuple[int, ...]:
        """The configured ranks whose data training rank ``rank`` takes: its own slot's,
        then the retired ranks dealt round-robin (so growing back is giving them away)."""
        lost = self.retired
        return (self.slots[rank], *(v for i, v in enumerate(lost) if i % self.size == rank))

    def payload(self) -> str:
        return json.dumps({"configured": self.configured, "slots": list(self.slots),
                           "after_gen": self.after_gen})

    def describe(self) -> str:
        return (f"{self.size} of {self.configured} ranks (launch ranks "
                f"{list(self.slots)}; retired {list(self.retired)})")


def _parse(payload: str | None, version: int) -> World | None:
    if payload is None:
        return None
    try:
        d = json.loads(payload)
        return World(int(d["configured"]), tuple(int(s) for s in d["slots"]),
                     int(d["after_gen"]), version)
    except (ValueError, KeyError, TypeError):
        return None


def versions(store: dist.Store) -> int:
    return int(store.add(_VERSIONS, 0))


def current(store: dist.Store, gen: int, configured: int) -> World:
    """The world of generation ``gen``: the newest record applying to it, or the
    launch world."""
    for v in range(versions(store), 0, -1):
        world = _parse(auth.read(store, _key(v)), v)
        if world is not None and world.after_gen < gen:
            return world
    return World.launch(configured)


def publish(store: dist.Store, world: World) -> World:
    """Record ``world`` as the newest version (sealed); returns it with its version."""
    version = int(store.add(_VERSIONS, 1))
    auth.put(store, _key(version), world.payload())
    return World(world.configured, world.slots, world.after_gen, version)


def record_resizability(store: dist.Store, why_not: str | None) -> None:
    """Rank 0 says whether the job can change size, shrinking and growing back alike
    (None), or why not."""
    auth.put(store, _RESIZABLE, json.dumps({"why_not": why_not}))


def resizability(store: dist.Store) -> tuple[bool, str | None]:
    """``(known, why_not)``: whether rank 0 said yet, and why the job cannot change
    size (None: it can)."""
    payload = auth.read(store, _RESIZABLE)
    if payload is None:
        return False, None
    try:
        why = json.loads(payload)["why_not"]
    except (ValueError, KeyError, TypeError, AttributeError):
        return False, None
    return True, None if why is None else str(why)


def mark_laid_out(store: dist.Store, world: World) -> None:
    """Record that the job's sharded state is laid out for ``world`` (it was resharded
    into it, or its shards fit it as they were): a process that joins it later (a
    replacement) is handed its state as usual instead of taking part in a resharding."""
    auth.put(store, f"{protocol.PREFIX}/world/laid_out/{world.version}", "1")


def laid_out(store: dist.Store, world: World) -> bool:
    """Whether the job's sharded state is laid out for ``world`` (see mark_laid_out);
    the launch world is the one the state was built in."""
    return world.version == 0 or auth.read(
        store, f"{protocol.PREFIX}/world/laid_out/{world.version}") is not None


def slot_of(environ: dict[str, str] | os._Environ[str]) -> int:
    """This process's launch rank (its ``RANK`` before any resize)."""
    return int(environ.get(ENV_SLOT) or environ.get("RANK", "0"))


def apply_to_environ(world: World, environ: os._Environ[str] | dict[str, str]) -> None:
    """Give a process of ``world`` its training rank and world size as ``RANK`` and
    ``WORLD_SIZE``; its slot and the configured size stay in internal variables."""
    slot = slot_of(environ)
    environ.setdefault(ENV_SLOT, str(slot))
    environ.setdefault(ENV_CONFIGURED_WORLD, str(world.configured))
    rank = world.rank_of(slot)
    if rank is None:
        raise RetiredSlot(f"launch rank {slot} is retired from the job (its node was lost "
                          "and the job shrank without it)")
    environ["RANK"], environ["WORLD_SIZE"] = str(rank), str(world.size)


class RetiredSlot(CheckpointlessError, RuntimeError):
    """A process started for a launch rank the current world does not train."""
