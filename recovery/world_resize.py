"""Leaving one world and running the script again in the next (ADR 0035).

A torch process group has a fixed size, and so has everything built over it: DDP's
reducer, FSDP2's mesh, a ``DistributedSampler``. When the job's world changes size (no
spare took a lost node's ranks, :mod:`recovery.world`), a survivor therefore runs the
user's script again, in the same process, at its new rank and size, as a replacement
runs it: imports, the interpreter and the CUDA context are kept, and the state comes
from memory instead of a peer. The steps:

1. The runtime, recovering into a generation whose world is not its own, calls
   :func:`leave`: its watchdog and durable writer stop, its snapshot engine (which holds
   the committed step) is kept in this module, and :class:`WorldResized` unwinds the
   script. It is a ``BaseException``: a script's ``except Exception`` must not catch it.
2. The worker bootstrap (``launcher.spare.run_assigned``) catches it, calls
   :func:`after_script` (the old default group is destroyed, the old objects freed) and
   :func:`enter_current_world` (``RANK``/``WORLD_SIZE`` of the new world), and runs the
   script again.
3. The script's new :class:`~recovery.Checkpointless` takes the engine back
   (:func:`take_carried`) and joins the generation as a rank that holds its own snapshot:
   a local rollback into the newly built objects, then the loop goes on.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from recovery import protocol, world
from recovery.errors import RecoveryImpossible
from recovery.events import Event
from replication import contract


class WorldResized(BaseException):
    """The job's world changed: the script runs again at its new rank and size."""

    def __init__(self, new: world.World) -> None:
        super().__init__(f"the job's world is now {new.describe()}")
        self.world = new


@dataclass
class Carried:
    """What a process brings from its old world into its new one: its snapshot engine
    (the committed step among its slots). It stands in for the previous generation's
    replicator where the runtime asks one for what it holds (``held``, ``engine``,
    ``replicas``, ``known_committed``); replicas of the old world's ranks are not kept,
    since placement changes with the world (the new one re-seeds them)."""

    engine: Any
    store: Any
    replicas: Any = None
    #: Ranks of the new world whose data this rank took in the old one: data-parallel
    #: twins, whose state is this rank's own (``Replicator(twins=...)`` serves it).
    twins: tuple[int, ...] = ()
    moved_from: dict[str, int] = field(default_factory=dict)

    def held(self) -> tuple[list[int], dict[int, list[int]]]:
        own = self.engine.held_steps()
        return own, {twin: own for twin in self.twins}

    @property
    def known_committed(self) -> int:
        return int(self.engine.protected_step)

    def committed_step(self) -> int:
        from replication.commit import committed_step

        return max(committed_step(self.store), self.known_committed)

    def abandon(self) -> None:
        return None


_carried: Carried | None = None


def leave(runtime: Any, new: world.World, gen: int) -> None:
    """Leave the current world for ``new`` (see the module docstring); raises
    :class:`WorldResized`. ``runtime`` is the :class:`~recovery.Checkpointless`."""
    global _carried
    replicator = runtime.replicator
    new_rank = new.rank_of(runtime.slot)
    runtime.log.emit(Event.WORLD_RESIZED, rank=runtime.rank, slot=runtime.slot, gen=gen,
                     old_world=runtime.world_size, world=new.size, new_rank=new_rank,
                     hosted=list(new.hosted(new_rank)) if new_rank is not None else [])
    runtime.watchdog.stop()
    if runtime.durable.writer is not None:
        runtime.durable.writer.close()
    if replicator is not None:  # else nothing held yet: it joins as a newcomer would
        refuse_unless_data_parallel(runtime)
        hosted = runtime.world.hosted(runtime.rank) if runtime.world.resized else ()
        twins = tuple(r for v in hosted[1:] if (r := new.rank_of(v)) is not None)
        _carried = Carried(replicator.engine, runtime.store, twins=twins,
                           moved_from={"rank": runtime.rank, "world": runtime.world_size})
    raise WorldResized(new)


def joined_world(runtime: Any, loader_entry: Any) -> world.World:
    """The world ``runtime`` (a new :class:`~recovery.Checkpointless`) trains in; in a
    shrunk world its tracked loader takes the data of the ranks it hosts too."""
    if not runtime.env.launched:
        return world.World.launch(runtime.world_size)
    gen = protocol.current_generation(runtime.store)
    current = world.current(runtime.store, gen + 1, runtime.configured)
    if current.resized:
        try:
            host_data(loader_entry, current.hosted(runtime.rank), runtime.configured)
        except RecoveryImpossible as exc:
            runtime.log.emit(Event.FATAL, reason=str(exc))
            protocol.set_fatal(runtime.store, str(exc), rank=runtime.rank, gen=gen)
            raise
    return current


def host_data(entry: Any, ranks: tuple[int, ...], configured: int) -> None:
    """Make the loader entry hand out, per step, the batches of every configured rank in
    ``ranks`` (:meth:`LoaderPosition.host`); one clear line if it cannot."""
    from recovery.loader_position import LoaderPosition

    if not isinstance(entry, LoaderPosition):
        raise RecoveryImpossible(
            f"the job shrank, and this rank must take the data of ranks {list(ranks)}, but "
            f"its loader ({type(entry).__qualname__ if entry is not None else 'none given'}) "
            "cannot be split by rank: pass a "
            "DataLoader with a DistributedSampler to Checkpointless(loader=...), or set "
            "recovery.on_no_spare=stop")
    entry.host(ranks, configured)


def refuse_unless_data_parallel(runtime: Any) -> None:
    """Stop the job with one line unless every module of the state is a data-parallel
    replica (a DDP, or a model whose gradients ``all_reduce_gradients`` averaged): only
    then is a rank's own state right at any world size, and a retired rank's the same
    as its host's. Sharded states (FSDP2) would need resharding, which is not built."""
    import torch

    sharded = [name for name, obj in runtime.state
               if isinstance(obj, torch.nn.Module) and name not in runtime._dp_entries]
    if sharded:
        runtime._fatal(
            f"the job's world changed size, but state {', '.join(map(repr, sharded))} is "
            "not a data-parallel replica (DDP, or a model passed to all_reduce_gradients), "
            "and resharding it in memory is not built: set recovery.on_no_spare=stop")


def take_carried() -> Carried | None:
    """The engine a previous run of the script left (once), or None."""
    global _carried
    carried, _carried = _carried, None
    return carried


def after_script() -> None:
    """The script was unwound by :class:`WorldResized`: destroy its default group (a
    new one of the new size is made when the script runs again) and free its objects,
    so no module of the old run (a DDP and its autograd hooks) is found again."""
    from recovery import elastic_controller

    if dist.is_initialized():
        dist.destroy_process_group()
    elastic_controller.controller().forget_generation()
    gc.collect()


def enter_current_world(environ: os._Environ[str] | dict[str, str]) -> None:
    """Set ``RANK``/``WORLD_SIZE`` for the world the job trains in now (a process
    started after a resize, or one running its script again). Nothing to do before the
    first resize: the world records are read only once one exists."""
    from recovery.env import WorkerEnv

    if not environ.get(contract.ENV_STORE):
        return
    env = WorkerEnv.from_environ(dict(environ))
    configured = int(environ.get(world.ENV_CONFIGURED_WORLD) or env.world_size)
    environ.setdefault(world.ENV_CONFIGURED_WORLD, str(configured))
    environ.setdefault(world.ENV_SLOT, str(env.rank))
    store = env.connect_store()
    if world.versions(store) == 0:
        return
    current = world.current(store, protocol.current_generation(store) + 1, configured)
    world.apply_to_environ(current, environ)
