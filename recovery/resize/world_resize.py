"""Leaving one world and running the script again in the next (ADR 0035).

A torch process group has a fixed size, and so has everything built over it: DDP's
reducer, FSDP2's mesh, a ``DistributedSampler``. When the job's world changes size (no
spare took a lost node's ranks, :mod:`recovery.generation.world`), a survivor therefore runs the
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
import sys
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from recovery.common.errors import RecoveryImpossible
from recovery.common.events import Event
from recovery.generation import protocol, world
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
    #: Ranks of the new world whose state is this rank's own, data-parallel as it is
    #: (``Replicator(twins=...)`` serves it to any of them that holds none).
    twins: tuple[int, ...] = ()
    #: A sharded (FSDP2) state is resharded instead (:mod:`recovery.resize.reshard`), from the
    #: old world's snapshots and these replicas of the old ranks.
    old_replicas: Any = None
    #: Live rollback's marks (replication.replica_protocol.marks) are not carried: the new world's
    #: ranks,
    #: holders and data position are other ones, so its marks start afresh.
    marks: Any = None
    old_rank: int = 0  # this process's rank and world size in the world it left
    old_world: int = 1
    dp_entries: set[str] = field(default_factory=set)  # the state's data-parallel entries
    old_shards: int = 0  # of a sharded state: the old layout's shard count (reshard)

    @property
    def sharded(self) -> bool:
        return self.old_replicas is not None

    def held(self) -> tuple[list[int], dict[int, list[int]]]:
        own = self.engine.held_steps()
        return own, {twin: own for twin in self.twins}

    @property
    def known_committed(self) -> int:
        return int(self.engine.protected_step)

    def committed_step(self) -> int:
        from replication.replica_protocol.commit import committed_step

        return max(committed_step(self.store), self.known_committed)

    def abandon(self) -> None:
        return None


_carried: Carried | None = None
_resharding: Carried | None = None  # taken by the new runtime, resharded in its handover
_announce = False  # a world was just entered: after_restore says so once


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
        refuse_unless_resizable(runtime, new)
        moved = {"old_rank": runtime.rank, "old_world": runtime.world_size}
        dp = set(runtime._dp_entries)
        twins = _twins(runtime.world, new, runtime.slot)
        if (sharded := _sharded_entries(runtime)):  # FSDP2: resharded from every copy
            from recovery.resize.reshard import shard_count

            # twins: only so the plan finds a provider for a rank that holds nothing;
            # the resharding serves it (every rank takes part)
            _carried = Carried(replicator.engine, runtime.store, dp_entries=dp,
                               old_replicas=replicator.replicas, **moved, twins=twins,
                               old_shards=shard_count(dict(iter(runtime.state))[sharded[0]]))
        else:
            _carried = Carried(replicator.engine, runtime.store, **moved,
                               dp_entries=dp, twins=twins)
    raise WorldResized(new)


def reshard(runtime: Any, target: int) -> int | None:
    """Restore ``target`` resharded at this world's size when the process brought a
    sharded state from another world (:mod:`recovery.resize.reshard`), or joins a world whose
    state is not laid out for it yet holding nothing (a node that joined, or a process
    lost with a node); then commit it again as the same step in the new layout. Returns
    the sharded bytes received, or None when there is nothing to reshard (the handover
    runs as usual)."""
    global _resharding
    carried = _resharding
    if carried is None and not (_sharded_entries(runtime) and runtime.env.launched
                                and not world.laid_out(runtime.store, runtime.world)):
        return None
    import torch

    from recovery.resize import reshard as resharding

    own = resharding.own_state(carried.engine, target) if carried is not None else None
    # Every rank must take the same path (the resharding is collective): one all-reduce,
    # which also tells a rank that holds nothing the old world's size and shard count.
    same = own is not None and resharding.same_local_shapes(runtime.state, own)
    vote = torch.tensor([0 if same else 1, carried.old_world if carried else 0,
                         carried.old_shards if carried else 0])
    dist.all_reduce(vote, op=dist.ReduceOp.MAX)
    differs, old_world, old_shards = (int(v) for v in vote)
    if not differs:  # HSDP without a replica group: each rank's own shards, as they are
        _resharding = None
        _laid_out(runtime)
        return None
    held = {}
    if carried is not None:
        held = {carried.old_rank: own, **resharding.replica_states(
            carried.engine, carried.old_replicas, carried.old_rank, target)}
    states, received = resharding.resharded_states(
        runtime.state, held, carried.old_rank if carried else None, (old_world, old_shards),
        runtime.rank, runtime.world_size)
    del held, own
    if carried is not None:
        carried.engine.forget()  # the old layout's slots
    runtime.state.restore(states)
    runtime.commit_initial(target)  # every copy of it again, in the new layout
    _resharding = None
    _laid_out(runtime)
    runtime.log.emit(Event.WORLD_RESIZED, rank=runtime.rank, resharded_step=target,
                     old_world=old_world, world=runtime.world_size, bytes_received=received,
                     held_nothing=carried is None)
    return received


def _laid_out(runtime: Any) -> None:
    if runtime.rank == 0 and runtime.env.launched:
        world.mark_laid_out(runtime.store, runtime.world)


def _sharded_entries(runtime: Any) -> list[str]:
    """The state's modules with sharded (DTensor) parameters: FSDP2."""
    import torch

    from recovery.resize.reshard import is_sharded

    return [name for name, obj in runtime.state if isinstance(obj, torch.nn.Module)
            and any(is_sharded(p) for p in obj.parameters())]


def _twins(old: world.World, new: world.World, slot: int) -> tuple[int, ...]:
    """The ranks of ``new`` this rank (launch rank ``slot``) offers its own state to:
    data-parallel, its state is any rank's but for the random state and per-rank extras,
    so it can serve every rank that holds none. A retired rank coming back is offered
    only by the rank that took its data (the work of serving is spread); a rank whose
    process died (with a node, say) by every rank, the lowest serving it."""
    hosts = {v: old.slots[r] for r in range(old.size) for v in old.hosted(r)}
    mine = new.rank_of(slot)
    return tuple(r for r, s in enumerate(new.slots)
                 if r != mine and (s not in old.retired or hosts.get(s) == slot))


def joined_world(runtime: Any, loader_entry: Any) -> world.World:
    """The world ``runtime`` (a new :class:`~recovery.Checkpointless`) trains in; in a
    shrunk world its tracked loader takes the data of the ranks it hosts too."""
    if not runtime.env.launched:
        return world.World.launch(runtime.world_size)
    gen = protocol.current_generation(runtime.store)
    current = world.current(runtime.store, gen + 1, runtime.configured)
    if current.resized and loader_entry is not None:  # a framework hosts its own loaders
        try:
            host_data(loader_entry, current.hosted(runtime.rank), runtime.configured)
        except RecoveryImpossible as exc:
            reason = cannot_resize(current, str(exc))
            runtime.log.emit(Event.FATAL, reason=reason)
            protocol.set_fatal(runtime.store, reason, rank=runtime.rank, gen=gen)
            raise RecoveryImpossible(reason) from None
    return current


def host_data(entry: Any, ranks: tuple[int, ...], configured: int) -> None:
    """Make the loader entry hand out, per step, the batches of every configured rank in
    ``ranks`` (:meth:`LoaderPosition.host`); one clear line if it cannot."""
    from recovery.loader.loader_position import LoaderPosition

    if not isinstance(entry, LoaderPosition):
        raise RecoveryImpossible(_unsplittable(entry))
    entry.host(ranks, configured)


def _unsplittable(entry: Any) -> str:
    return (f"its loader ({type(entry).__qualname__ if entry is not None else 'none'}) "
            "cannot be split by rank: pass a DataLoader with a DistributedSampler to "
            "Checkpointless(loader=...)")


def why_not_resizable(runtime: Any) -> str | None:
    """Why the job cannot go on at another size, or None if it can: every module of its
    state must be a data-parallel replica (a DDP, or a model whose gradients
    ``all_reduce_gradients`` averaged: a rank's own state is right at any size, and a
    retired rank's is its host's) or sharded by 1-D FSDP2 (resharded,
    :mod:`recovery.resize.reshard`); and its loader must split by rank
    (:mod:`recovery.loader.hosted_loader`)."""
    import torch

    from recovery.loader.loader_position import LoaderPosition
    from recovery.resize.reshard import sharding_refusal

    for name, obj in runtime.state:  # an entry that knows its own layout (a DeepSpeed engine)
        own = getattr(obj, "resize_refusal", None)
        if callable(own) and (why := own()) is not None:
            return f"state {name!r}: {why}"
    fsdp = _sharded_entries(runtime)
    ddp = torch.nn.parallel.DistributedDataParallel
    other = [name for name, obj in runtime.state if isinstance(obj, torch.nn.Module)
             and not isinstance(obj, ddp) and name not in runtime._dp_entries
             and name not in fsdp]
    if other:
        return (f"state {', '.join(map(repr, other))} is neither a data-parallel replica "
                "(DDP, or a model passed to all_reduce_gradients) nor sharded by FSDP2")
    entries = dict(iter(runtime.state))
    for name in fsdp:
        if (why := sharding_refusal(entries[name])) is not None:
            return f"state {name!r}: {why}"
    integration = getattr(runtime, "resize_refusal", None)  # a framework's own loaders
    if integration is not None:
        return integration()
    entry = entries.get("loader")
    return entry.split_refusal() if isinstance(entry, LoaderPosition) else _unsplittable(entry)


def publish_resizability(runtime: Any) -> None:
    """Rank 0 records whether the job can change size (:func:`why_not_resizable`), when
    that changes: the agents shrink a job only if it can, and stop it otherwise."""
    if runtime.rank != 0 or not runtime.env.launched:
        return
    why = why_not_resizable(runtime)  # shrinking and growing back alike
    if getattr(runtime, "_resizability_said", ()) != (why,):
        world.record_resizability(runtime.store, why)
        runtime._resizability_said = (why,)


def refuse_unless_resizable(runtime: Any, new: world.World) -> None:
    """Stop the job with one line if it cannot go on at ``new``'s size."""
    why = why_not_resizable(runtime) if new.resized else None
    if why is not None:
        runtime._fatal(cannot_resize(new, why))


def cannot_resize(new: world.World, why: str) -> str:
    """The one line of a job that cannot go on at another size."""
    if new.resized:
        return (f"launch ranks {list(new.retired)} were lost and no spare node took them "
                f"over, and the job cannot go on without them: {why} (recovery.on_no_spare="
                "stop stops here without trying)")
    return f"the job cannot grow back to its full size: {why}"


def gradient_weight(runtime: Any) -> float | None:
    """What this rank's gradient counts for in the sum over ranks, when that is not the
    usual ``1 / world size``: in a shrunk world whose ranks take different numbers of
    configured ranks' batches, ``hosted / configured`` (so the average stays the mean
    over the global batch: a rank with two ranks' batches counts twice). None otherwise."""
    w = runtime.world
    if not w.resized or not w.uneven:
        return None
    return w.hosted_counts[runtime.rank] / w.configured


def after_restore(runtime: Any, target: int) -> int:
    """After every restore: weigh gradients for an uneven split
    (:func:`weight_gradients`; returns how many DDPs), and, on rank 0 of a world just
    entered, say on the console at what size the job trains and how many copies of each
    state exist again (the handover placed the replicas for this world)."""
    global _announce
    hooked = weight_gradients(runtime)
    if _announce and runtime.rank == 0 and runtime.replicator is not None:
        rep, w = runtime.replicator, runtime.world
        spread = len(set(rep.node_of_rank)) >= rep.factor
        where = ("on other nodes" if spread
                 else "not all on other nodes: a node loss is not survived")
        print(f"checkpointless: training at {w.size} of {w.configured} ranks (launch ranks "
              f"{list(w.slots)}) from step {target}; {rep.factor} copies of every state "
              f"again, {where}", file=sys.stderr, flush=True)
    _announce = False
    return hooked


def weight_gradients(runtime: Any) -> int:
    """Give every DDP of this process a comm hook that weighs this rank's gradients by
    :func:`gradient_weight` before their sum (DDP's own averages by the world size), and
    the state's FSDP2 modules a backward hook that does (:func:`_weigh_sharded`);
    returns how many modules. Called after each restore (a restore rebuilds the reducers). A DDP
    with a hook of the user's keeps it, unweighted: its gradients then deviate by the
    uneven split, as the recovery event's ``unweighted_ddps`` says."""
    weight = gradient_weight(runtime)
    if weight is None:
        return 0
    from torch.nn.parallel import DistributedDataParallel

    hooked = skipped = 0
    for ddp in [o for o in gc.get_objects() if isinstance(o, DistributedDataParallel)
                and getattr(o.process_group, "closed", True) is False]:  # this world's
        try:
            ddp.register_comm_hook((weight, ddp.process_group), _weighted_sum)
            hooked += 1
        except RuntimeError:  # one registered already: the user's
            skipped += 1
    if skipped:
        runtime.log.emit(Event.WORLD_RESIZED, rank=runtime.rank, unweighted_ddps=skipped)
    return hooked + _weigh_sharded(runtime, weight * runtime.world_size)


def _weigh_sharded(runtime: Any, factor: float) -> int:
    """Weigh this rank's gradients of every FSDP2 module of the state (returns how
    many). FSDP2 averages them over the ranks in its reduce-scatter and has no hook for
    one rank's part, so the gradient flowing into the module's output is scaled by
    ``factor`` (``weight x world size``) instead: backward is linear in it. A loss term
    computed from the parameters outside the module's output (a hand-written weight
    penalty) is not weighed. Once per module object: the script builds new ones in a
    world of another size."""
    entries = dict(iter(runtime.state))
    names = _sharded_entries(runtime)
    for name in names:
        module = entries[name]
        if getattr(module, "_checkpointless_weighed", None) is None:
            module._checkpointless_weighed = module.register_full_backward_pre_hook(
                lambda _m, grads, f=factor: tuple(None if g is None else g * f for g in grads))
    return len(names)


def _weighted_sum(state, bucket):  # type: ignore[no-untyped-def]
    """DDP's all-reduce of one bucket, this rank's part weighed; ``state`` is ``(weight,
    group)``. Unannotated: DDP checks a hook's annotations against its own types, and
    this module's are strings (``from __future__ import annotations``)."""
    weight, group = state
    buffer = bucket.buffer().mul_(weight)
    work = dist.all_reduce(buffer, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def take_carried(runtime: Any) -> Carried | None:
    """What a previous run of the script in this process left (once), or None; its
    engine is rebound to ``runtime``'s state, and the entries it knew to be
    data-parallel stay known (a failure before this run's first step asks again)."""
    global _carried, _resharding, _announce
    carried, _carried = _carried, None
    _resharding = carried if carried is not None and carried.sharded else None
    _announce = carried is not None
    if carried is not None:
        carried.engine.rebind(runtime.state)
        runtime._dp_entries |= carried.dp_entries & {name for name, _ in runtime.state}
    return carried


def after_script() -> None:
    """The script was unwound by :class:`WorldResized`: destroy its default group (a
    new one of the new size is made when the script runs again) and free its objects,
    so no module of the old run (a DDP and its autograd hooks) is found again."""
    from recovery.process_group import controller

    if dist.is_initialized():
        dist.destroy_process_group()
    controller.controller().forget_generation()
    gc.collect()


def enter_current_world(environ: os._Environ[str] | dict[str, str]) -> None:
    """Set ``RANK``/``WORLD_SIZE`` for the world the job trains in now (a process
    started after a resize, or one running its script again). Nothing to do before the
    first resize: the world records are read only once one exists."""
    from recovery.common.env import WorkerEnv

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
