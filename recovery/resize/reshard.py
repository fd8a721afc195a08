"""FSDP2 state resharded in memory when the job's world changes size (ADR 0035).

Data-parallel state is any rank's, so a shrink restores each survivor's own snapshot.
FSDP2 state is not: the holder of shard ``i`` of ``S`` has rows ``[i*c, (i+1)*c)`` of
every sharded parameter and of its optimizer state (``c = ceil(rows / S)``, torch.chunk's
split along dim 0, as ``fully_shard`` makes it). In 1-D FSDP2 rank ``i`` holds shard
``i``; in HSDP (replicate x shard) rank ``r`` holds shard ``r % S``, as does every other
replica group. At another size every rank needs other rows. The rows of the ranks that
were lost live on in the survivors' replicas of them. So, at the committed step:

1. each survivor decodes the old ranks' states it holds (its own snapshot, and its
   replicas), verified segment by segment; a rank that holds nothing (a node that
   joined the job, or a process lost with a node) takes part all the same;
2. one all-gather says who holds which old rank; the lowest holder of each old shard
   provides it (a shard nobody holds makes the resharding impossible, said in one line);
3. for every sharded tensor, in the same order on every rank (the keys of the
   unsharded state below), each old shard is broadcast from its provider and every rank
   keeps the rows of its new shard (its index on the new mesh's sharding dimension):
   one shard in flight at a time, so the memory on top of the state is one old shard,
   not the full model;
4. everything that is not sharded (buffers, the scheduler, RNG, the data position) is
   the rank's own old state, or, for a rank that holds nothing, the lowest holder's
   (one object broadcast, its shards left out); the new state is restored into the
   objects the script built at the new size, and committed again as the same step in
   the new layout.

The result is exact: the full parameters and optimizer state after a shrink or a grow
equal those before it, bit for bit (``tests/test_shrink.py``). The broadcasts send each
old shard to every rank, a full state's bytes per rank (a point-to-point plan would send
each only the rows it needs). Only ``Shard(0)`` placements are resharded (1-D FSDP2 and
HSDP); others are refused before the job shrinks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from recovery.common.errors import RecoveryImpossible
from replication.snapshots.digest_copy import verify_segments
from replication.training_state.layout import unflatten_segment


def is_sharded(t: Any) -> bool:
    return type(t).__name__ == "DTensor"


def layout_of(module: torch.nn.Module) -> str | None:
    """``"fsdp"`` (1-D ``Shard(0)``), ``"hsdp"`` (``Replicate`` x ``Shard(0)``), None
    for a module without sharded parameters; ValueError (the reason) for any other."""
    kinds = set()
    for name, p in module.named_parameters():
        if not is_sharded(p):
            continue
        placements = tuple(type(pl).__name__ for pl in p.placements)
        if placements == ("Shard",) and p.placements[0].dim == 0:
            kinds.add("fsdp")
        elif placements == ("Replicate", "Shard") and p.placements[1].dim == 0:
            kinds.add("hsdp")
        else:
            raise ValueError(f"parameter {name!r} is laid out as {placements} over a "
                             f"{p.device_mesh.ndim}-D mesh; only FSDP2's Shard(0), and HSDP "
                             "(Replicate x Shard(0)), change world size")
    if len(kinds) > 1:
        raise ValueError("its parameters mix FSDP2 and HSDP layouts")
    return kinds.pop() if kinds else None


def sharding_refusal(module: torch.nn.Module) -> str | None:
    """Why ``module``'s sharded parameters cannot change world size, or None."""
    try:
        layout_of(module)
    except ValueError as exc:
        return str(exc)
    return None


def same_local_shapes(state: Any, own: dict[str, Any]) -> bool:
    """Whether this rank's old shards have the shapes of the new objects' local shards:
    then the rank's own state restores as it is (HSDP losing a replica group: the shard
    size is unchanged), and nothing is resharded."""
    for name, obj in state:
        if name not in own:
            continue
        if isinstance(obj, torch.nn.Module):
            for key, dst in obj.state_dict().items():
                if is_sharded(dst) and tuple(own[name][key].shape) != tuple(
                        dst.to_local().shape):
                    return False
        elif isinstance(obj, torch.optim.Optimizer):
            params = [p for g in obj.param_groups for p in g["params"]]
            for pid, entry in own[name].get("state", {}).items():
                p = params[pid]
                for value in entry.values():
                    if _sharded_value(p, value) and tuple(value.shape) != tuple(
                            p.to_local().shape):
                        return False
    return True


def _decode(buffer: torch.Tensor, meta: Any) -> dict[str, Any]:
    verify_segments(buffer, meta)
    return {seg.name: unflatten_segment(buffer[seg.offset: seg.offset + seg.nbytes], seg,
                                        meta.skeletons[seg.name])
            for seg in meta.layout.segments}


def own_state(engine: Any, step: int) -> dict[str, Any]:
    """This rank's own old state at ``step``, decoded and verified."""
    mine = engine.slot_for(step)
    return _decode(mine.buffer, mine.meta())


def replica_states(engine: Any, replicas: Any, own: int,
                   step: int) -> dict[int, dict[str, Any]]:
    """The old ranks' states this rank holds replicas of at ``step`` (a replica's
    segments shared with the own snapshot come from it), decoded and verified."""
    mine = engine.slot_for(step)
    held = {}
    for src, steps in replicas.held_steps().items():
        if step not in steps or src == own:
            continue
        rslot = replicas.get(src, step)
        buffer = rslot.host_copy()
        for name in rslot.shared:
            seg = rslot.meta.layout.segment(name)
            buffer[seg.offset: seg.offset + seg.nbytes].copy_(mine.segment_bytes(name))
        held[src] = _decode(buffer, rslot.meta)
    return held


def shard_coordinates(t: Any) -> tuple[int, int]:
    """``(index, count)``: which of the dim-0 shards of the sharded tensor ``t`` this
    rank holds, and how many there are (the size of its mesh's sharding dimension)."""
    d = next(i for i, pl in enumerate(t.placements) if type(pl).__name__ == "Shard")
    return t.device_mesh.get_local_rank(mesh_dim=d), t.device_mesh.size(d)


def shard_count(module: torch.nn.Module) -> int:
    """How many dim-0 shards ``module``'s sharded parameters are split into."""
    return next(shard_coordinates(p)[1] for p in module.parameters() if is_sharded(p))


def providers(held: set[int], old_world: int, old_shards: int,
              world: int) -> tuple[dict[int, int], list[int]]:
    """Old shard index -> the lowest new rank holding it (any old rank ``o`` holds shard
    ``o % old_shards``: 1-D FSDP2 has one shard per rank, HSDP one per rank of a replica
    group), and the new ranks that hold nothing (collective: one all-gather)."""
    mask = torch.zeros(old_world, dtype=torch.int64)
    mask[sorted(held)] = 1
    masks = [torch.zeros_like(mask) for _ in range(world)]
    dist.all_gather(masks, mask)
    out, missing = {}, []
    for i in range(old_shards):
        olds = range(i, old_world, old_shards)
        holders = [r for r in range(world) if any(int(masks[r][o]) for o in olds)]
        if holders:
            out[i] = holders[0]
        else:
            missing.extend(olds)
    if missing:
        raise RecoveryImpossible(
            f"the job's world changed size, but no surviving rank holds the state of old "
            f"rank(s) {sorted(missing)} (their own copy and every replica were lost), so "
            "its FSDP2 shards cannot be resharded")
    return out, [r for r in range(world) if not int(masks[r].sum())]


def gather_rows(shape: torch.Size, dtype: torch.dtype, old_shards: int,
                provider: dict[int, int], shard_of: Callable[[int], torch.Tensor],
                new: tuple[int, int], rank: int) -> torch.Tensor:
    """This rank's new shard (rows of dim 0; ``new`` is its ``(index, count)``) of a
    tensor of global ``shape``, from the old shards, each broadcast by its provider
    (collective: every rank, same order)."""
    rows, rest = shape[0], tuple(shape[1:])
    c_old, c_new = math.ceil(rows / old_shards), math.ceil(rows / new[1])
    lo, hi = min(new[0] * c_new, rows), min((new[0] + 1) * c_new, rows)
    out = torch.empty((hi - lo, *rest), dtype=dtype)
    for i in range(old_shards):
        a, b = min(i * c_old, rows), min((i + 1) * c_old, rows)
        if a >= b:
            continue
        if provider[i] == rank:
            buf = shard_of(i).contiguous().clone()
        else:
            buf = torch.empty((b - a, *rest), dtype=dtype)
        dist.broadcast(buf, src=provider[i])
        x, y = max(a, lo), min(b, hi)
        if x < y:
            out[x - lo: y - lo].copy_(buf[x - a: y - a])
    return out


@dataclass(frozen=True)
class _Left:
    """A sharded tensor left out of the state sent to a rank that holds nothing."""

    dtype: torch.dtype


def _sharded_value(p: Any, value: Any) -> bool:
    """Whether an optimizer state value of parameter ``p`` is sharded as ``p`` is."""
    return is_sharded(p) and isinstance(value, torch.Tensor) and value.ndim == p.ndim


def _without_shards(state: Any, own: dict[str, Any]) -> dict[str, Any]:
    """``own`` with every sharded tensor left out (:class:`_Left`): what a rank that
    holds nothing takes from another, the shards being gathered anyway."""
    out = dict(own)
    for name, obj in state:
        if name not in out:
            continue
        if isinstance(obj, torch.nn.Module):
            live = obj.state_dict()
            out[name] = {k: _Left(v.dtype) if is_sharded(live.get(k)) else v
                         for k, v in own[name].items()}
        elif isinstance(obj, torch.optim.Optimizer):
            params = [p for g in obj.param_groups for p in g["params"]]
            out[name] = {**own[name], "state": {
                pid: {k: _Left(v.dtype) if _sharded_value(params[pid], v) else v
                      for k, v in e.items()}
                for pid, e in own[name].get("state", {}).items()}}
    return out


def _base(state: Any, held: dict[int, dict[str, Any]], own: int | None, empty: list[int],
          rank: int, world: int) -> dict[str, Any]:
    """What is not sharded (buffers, the scheduler, RNG, the data position): the rank's
    own old state; a rank that holds nothing (a node that joined) gets the lowest
    holding rank's (collective when any rank holds nothing)."""
    if not empty:
        assert own is not None
        return held[own]
    src = min(r for r in range(world) if r not in empty)
    box = [_without_shards(state, held[own]) if rank == src and own is not None else None]
    dist.broadcast_object_list(box, src=src)
    return held[own] if own is not None else box[0]


def resharded_states(state: Any, held: dict[int, dict[str, Any]], own: int | None,
                     old: tuple[int, int], rank: int, world: int) -> tuple[dict[str, Any], int]:
    """The states to restore at the new size, and the sharded bytes this rank got.
    ``held``: the old ranks' states this rank holds (``own`` is its own old rank, None
    for a rank that holds nothing); ``old``: the old world's ``(size, shard count)``."""
    old_world, old_shards = old
    provider, empty = providers(set(held), old_world, old_shards, world)
    source = {o % old_shards: o for o in sorted(held, reverse=True)}  # the lowest old rank
    states = dict(_base(state, held, own, empty, rank, world))
    received = 0
    for name, obj in state:
        if name not in states:
            continue
        if isinstance(obj, torch.nn.Module):
            new = dict(states[name])
            for key, dst in obj.state_dict().items():
                if is_sharded(dst):
                    new[key] = gather_rows(dst.shape, dst.dtype, old_shards, provider,
                                           lambda i, n=name, k=key: held[source[i]][n][k],
                                           shard_coordinates(dst), rank)
                    received += new[key].numel() * new[key].element_size()
            states[name] = new
        elif isinstance(obj, torch.optim.Optimizer):
            params = [p for g in obj.param_groups for p in g["params"]]
            base = states[name]
            new_state = {}
            for pid, entry in base["state"].items():
                p = params[pid]
                new_entry = dict(entry)
                for key, value in entry.items():
                    if isinstance(value, _Left) or _sharded_value(p, value):
                        new_entry[key] = gather_rows(
                            p.shape, value.dtype, old_shards, provider,
                            lambda i, n=name, q=pid, k=key: held[source[i]][n]["state"][q][k],
                            shard_coordinates(p), rank)
                new_state[pid] = new_entry
            states[name] = {**base, "state": new_state}
    return states, received
