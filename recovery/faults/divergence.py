"""Run-time checks that the ranks still train one model, and the lines that say so.

"Bit-identical" is a test-time claim unless a run checks it. Three checks turn it into
a run-time one, each an event plus one console line, and training goes on:

- :func:`check_replicas_agree`: data-parallel ranks that start from different weights
  (nanoGPT seeds each rank differently and relied on DDP's broadcast of rank 0's);
- drift (:mod:`replication.replica_protocol.drift`): data-parallel replicas whose snapshots stop
  matching mid-run;
- replay differences (:mod:`replication.snapshots.replay_check`): a step replayed after a
  recovery whose snapshot differs from the first run's.

Kept out of :mod:`recovery.runtime.checkpointless`, which only decides when to run them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from recovery.common.events import Event
from replication.replica_protocol.replicator import Replicator


def check_replicas_agree(model: torch.nn.Module, device: torch.device, *, rank: int,
                         world_size: int, step: int, log: Any,
                         wait: Callable[[Any], None]) -> None:
    """Say so, loudly and once, when data-parallel ranks hold different weights.

    Averaging gradients keeps equal weights equal; it never makes different ones
    equal. nanoGPT seeds each rank differently and relies on DDP's constructor
    broadcasting rank 0's weights: adapted to the runtime's API without DDP, every rank
    trained its own model, with no warning. One hash of the parameters (not the
    buffers, which may differ per rank: batch-norm statistics) and one all-gather, at
    the first call of each generation (a replacement's restored weights too). ``wait``
    is the runtime's failure-aware wait for the all-gather.
    """
    h = xxhash.xxh3_64()  # read in place: a copy of each tensor cost more than the hash
    for p in model.parameters():
        h.update(p.detach().reshape(-1).view(torch.uint8).cpu().numpy())
    mine = torch.tensor([h.intdigest() & ((1 << 63) - 1)], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    wait(dist.all_gather(gathered, mine, async_op=True))
    groups: dict[int, list[int]] = {}
    for r, t in enumerate(gathered):
        groups.setdefault(int(t.item()), []).append(r)
    if len(groups) == 1:
        return
    split = " vs ".join(str(ranks) for ranks in sorted(groups.values()))
    log.emit(Event.REPLICAS_DIFFER, rank=rank, step=step, groups=split)
    if rank == 0:
        print(f"checkpointless: WARNING: all_reduce_gradients averages the gradients of "
              f"a model whose weights already differ across ranks at step {step} "
              f"(ranks with equal weights: {split}): the ranks train different models. "
              "Seed every rank the same before building the model, or broadcast rank "
              "0's weights once (nanoGPT seeds by rank and relies on DDP's broadcast).",
              file=sys.stderr, flush=True)


def report(replicator: Replicator, *, rank: int, gen: int, log: Any, warned: bool) -> bool:
    """Report what the run-time checks found since the last step: data-parallel replicas
    that drifted apart, and replayed steps whose snapshot differs from the first run's
    (the recovery 'succeeded', but training left the path a failure-free run takes).
    Events, and one console line per drift and per recovery (``warned``: that line was
    printed already since the last recovery); returns the new ``warned``."""
    for step, name, split in replicator.drift.take():
        log.emit(Event.REPLICAS_DRIFTED, rank=rank, step=step, entry=name, split=split)
        if rank == 0:
            print(f"checkpointless: WARNING: state entry {name!r} was {split} at step "
                  f"{step}: data-parallel replicas drifted apart (a gradient not "
                  "all-reduced, a rank-dependent update, a non-deterministic "
                  "collective); the ranks no longer train one model.",
                  file=sys.stderr, flush=True)
    for step, names in replicator.take_replay_differences():
        log.emit(Event.REPLAY_DIVERGED, rank=rank, step=step, gen=gen, segments=names)
        if not warned:
            warned = True
            print(f"checkpointless: WARNING: rank {rank} replayed step {step} after "
                  f"the recovery and its state differs from the first run's in "
                  f"{', '.join(names)}: state the runtime does not know about changed "
                  "(register it: a batch fetched ahead of its step, a counter kept on "
                  "an object), or the step is not deterministic. Training goes on, off "
                  "the path a failure-free run takes.", file=sys.stderr, flush=True)
    return warned
