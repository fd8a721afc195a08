"""``CachedLoader``'s arguments, checked and resolved (from a ``DataLoader`` when given one,
and the data-parallel coordinates from torch.distributed when not given)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler

from .config import DataloaderCacheConfig

_CONFIG_FIELDS = {f.name: f for f in dataclasses.fields(DataloaderCacheConfig)}


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def build_config(
    config: DataloaderCacheConfig | None, overrides: dict[str, Any]
) -> DataloaderCacheConfig:
    """The loader's settings: ``config`` with keyword overrides, each checked."""
    unknown = sorted(set(overrides) - set(_CONFIG_FIELDS))
    if unknown:
        raise TypeError(
            f"CachedLoader got unknown option(s) {unknown}; "
            f"DataloaderCacheConfig fields are {sorted(_CONFIG_FIELDS)}"
        )
    cfg = dataclasses.replace(config or DataloaderCacheConfig(), **overrides)
    for name, f in _CONFIG_FIELDS.items():
        lo = f.metadata.get("min")
        value = getattr(cfg, name)
        if lo is not None and value < lo:
            raise ValueError(f"dataloader_cache.{name} must be >= {lo}, got {value}")
    return cfg


def is_iterable_dataset(dataset: Any) -> bool:
    """Whether ``dataset`` is read as a stream (no random access by index)."""
    if isinstance(dataset, IterableDataset):
        return True
    return not hasattr(dataset, "__getitem__") and hasattr(dataset, "__iter__")


@dataclasses.dataclass
class Arguments:
    """``CachedLoader``'s data arguments, as given and then resolved."""

    dataset: Any
    batch_size: int | None
    seed: int | None
    dp_rank: int | None
    dp_world: int | None
    shuffle: bool | None
    drop_last: bool | None
    collate_fn: Callable[[list[Any]], Any] | None

    def take_from_dataloader(self, loader: DataLoader) -> None:
        """Fill what was not given from a ``DataLoader`` (and its ``DistributedSampler``)."""
        if self.batch_size is None and loader.batch_size is None:
            raise ValueError(
                "the DataLoader has no batch_size (custom batch_sampler or batch_size="
                "None); pass batch_size= to CachedLoader"
            )
        self.dataset = loader.dataset
        self.batch_size = self.batch_size if self.batch_size is not None else loader.batch_size
        self.collate_fn = self.collate_fn or loader.collate_fn
        self.drop_last = loader.drop_last if self.drop_last is None else self.drop_last
        sampler = loader.sampler
        if isinstance(sampler, DistributedSampler):  # keep its sharding and seed
            self.shuffle = sampler.shuffle if self.shuffle is None else self.shuffle
            self.seed = sampler.seed if self.seed is None else self.seed
            self.dp_rank = sampler.rank if self.dp_rank is None else self.dp_rank
            self.dp_world = sampler.num_replicas if self.dp_world is None else self.dp_world
        elif self.shuffle is None:
            self.shuffle = isinstance(sampler, RandomSampler)

    def validate(self, worker_mode: str) -> None:
        """Check the arguments; data-parallel coordinates default to torch.distributed's."""
        if self.batch_size is None or self.batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {self.batch_size!r}")
        if worker_mode not in ("thread", "process"):
            raise ValueError(f"worker_mode must be 'thread' or 'process', got {worker_mode!r}")
        if self.dp_rank is None or self.dp_world is None:
            r, w = _dist_rank_world()
            self.dp_rank = r if self.dp_rank is None else self.dp_rank
            self.dp_world = w if self.dp_world is None else self.dp_world
        if not 0 <= self.dp_rank < self.dp_world:
            raise ValueError(f"dp_rank {self.dp_rank} outside [0, dp_world={self.dp_world})")
