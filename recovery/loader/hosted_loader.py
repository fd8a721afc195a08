"""One rank's loader standing for several ranks' loaders, after the job shrank.

When a job trains on fewer ranks than it was launched with (ADR 0035), each remaining
rank takes the data of some retired ranks as well as its own, so every step still
consumes the configured world's global batch, in the failure-free order. For a
``DataLoader`` over a ``DistributedSampler`` that means: one loader per hosted rank, each
with the sampler the configured world gave that rank (same dataset, shuffle, seed,
``drop_last`` and epoch), stepped together, and each step's batches concatenated along
the first dimension into one larger batch.

A loss that is a mean over the batch then gives, averaged over the smaller world by DDP
or ``all_reduce_gradients``, the failure-free gradient in exact arithmetic (each hosted
batch has the same size, as a ``DistributedSampler`` pads the ranks to the same count).
The memory cost is the activations of the larger batch. What differs in floating point:
the order of the sums, and a random augmentation drawn in the loader's workers (their
seeds come from this rank's generator, not the retired ranks').
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from recovery.common.errors import RecoveryImpossible


def refusal(loader: Any) -> str | None:
    """Why ``loader`` cannot stand for several ranks, or None if it can."""
    sampler = getattr(loader, "sampler", None)
    if not isinstance(loader, DataLoader):
        return f"its loader ({type(loader).__qualname__}) is not a DataLoader"
    if not isinstance(sampler, DistributedSampler):
        return (f"its DataLoader's sampler ({type(sampler).__qualname__}) does not split the "
                "data by rank: use a DistributedSampler")
    if getattr(loader, "batch_size", None) is None:
        return "its DataLoader has a batch_sampler of its own, which cannot be split by rank"
    return None


def cannot_host(ranks: tuple[int, ...], why: str) -> RecoveryImpossible:
    """The one-line error of a loader that cannot take the data of ``ranks``."""
    return RecoveryImpossible(f"this rank must take the data of ranks {list(ranks)}, but {why}")


def rank_loader(loader: DataLoader, rank: int, world: int) -> DataLoader:
    """The loader the configured world's ``rank`` would iterate in this pass."""
    s = loader.sampler
    assert isinstance(s, DistributedSampler)
    sampler: DistributedSampler = DistributedSampler(
        s.dataset, num_replicas=world, rank=rank, shuffle=s.shuffle, seed=s.seed,
        drop_last=s.drop_last)
    sampler.set_epoch(s.epoch)
    workers = loader.num_workers
    return DataLoader(
        loader.dataset, batch_size=loader.batch_size, sampler=sampler, num_workers=workers,
        collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, drop_last=loader.drop_last,
        timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context if workers else None,
        generator=loader.generator, prefetch_factor=loader.prefetch_factor if workers else None,
        persistent_workers=False)


def concat(batches: list[Any]) -> Any:
    """The batches of one step, joined along the first dimension, structure kept."""
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(batches)
    if isinstance(first, Mapping):
        return type(first)({k: concat([b[k] for b in batches]) for k in first})
    if isinstance(first, tuple) and hasattr(first, "_fields"):  # a namedtuple
        return type(first)(*(concat(list(parts)) for parts in zip(*batches, strict=True)))
    if isinstance(first, (list, tuple)):
        if first and all(isinstance(x, (torch.Tensor, Mapping, list, tuple)) for x in first):
            return type(first)(concat(list(parts)) for parts in zip(*batches, strict=True))
        return type(first)(x for b in batches for x in b)  # per-sample values (strings)
    raise RecoveryImpossible(f"cannot join batches of type {type(first).__qualname__} from "
                             "several ranks into one (the job shrank)")


class HostedIterator:
    """The iterator of one pass over every hosted rank's loader, in step."""

    def __init__(self, loaders: list[DataLoader], skip: Any, done: int) -> None:
        self._its = []
        for loader in loaders:
            it = iter(loader)
            if done:
                skip(loader, it, done)
            self._its.append(it)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        return concat([next(it) for it in self._its])


class Hosting:
    """A tracked loader's part in a shrunk world: the configured ranks whose batches it
    hands out, joined. Used alike by the runtime's tracked loaders
    (:class:`recovery.loader.loader_position.LoaderPosition`) and Lightning's
    (:class:`recovery.integrations.lightning.data.ResumableLoader`)."""

    def __init__(self, loader: Any, ranks: tuple[int, ...], configured: int,
                 why_not: str | None = None) -> None:
        """Raises :class:`RecoveryImpossible` with ``why_not`` (the caller's own reason)
        or :func:`refusal`'s, in one line, if ``loader`` cannot."""
        why = why_not or refusal(loader)
        if why is not None:
            raise cannot_host(ranks, why)
        self.ranks, self.configured = tuple(ranks), configured
        # a pass has as many steps as the configured world's (the sampler pads the ranks
        # to one count): measured once, not at every step's end
        self.length = len(rank_loader(loader, self.ranks[0], configured))

    def open(self, loader: Any, skip: Any, done: int) -> HostedIterator:
        """A pass over every hosted rank's loader, ``done`` batches in."""
        return HostedIterator([rank_loader(loader, r, self.configured) for r in self.ranks],
                              skip, done)
