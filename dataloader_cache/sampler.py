"""Deterministic, random-access batch sampling for map-style datasets.

Why random access instead of an iterator: recovery rolls a rank back to an arbitrary
committed (epoch, step), and prefetch threads build several steps at once. A pure
function ``(epoch, step) -> indices`` makes both trivial and makes the batch for a given
(epoch, step, dp_rank) identical in every run and after every recovery, whatever happened
before. The order is exactly ``torch.utils.data.DistributedSampler``'s: a ``randperm``
drawn from a generator seeded with ``seed + epoch`` (nothing else), padded by wrapping so
every rank gets the same number of samples (unequal counts would hang collectives), then
strided by rank.
"""

from __future__ import annotations

import math
import threading

import torch


class DeterministicSampler:
    """Index batches for one data-parallel rank, as a pure function of (epoch, step)."""

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        seed: int = 0,
        dp_rank: int = 0,
        dp_world: int = 1,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        if num_samples <= 0:
            raise ValueError(f"dataset is empty (len={num_samples})")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank {dp_rank} outside [0, dp_world={dp_world})")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.per_rank = math.ceil(num_samples / dp_world)
        self.total = self.per_rank * dp_world
        self._lock = threading.Lock()
        self._cached_epoch: int | None = None
        self._cached: list[int] = []

    def __getstate__(self) -> dict[str, object]:
        """Picklable (sent to worker processes): drop the lock and the memoised epoch."""
        state = dict(self.__dict__)
        del state["_lock"]
        state["_cached_epoch"], state["_cached"] = None, []
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def num_batches(self) -> int:
        """Batches per epoch for this rank (the same for every rank and every epoch)."""
        if self.drop_last:
            return self.per_rank // self.batch_size
        return math.ceil(self.per_rank / self.batch_size)

    def __len__(self) -> int:
        return self.num_batches()

    def rank_indices(self, epoch: int) -> list[int]:
        """All sample indices of this rank for ``epoch``, in order (memoised per epoch)."""
        with self._lock:
            if self._cached_epoch == epoch:
                return self._cached
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_samples, generator=g).tolist()
        else:
            order = list(range(self.num_samples))
        pad = self.total - len(order)
        while pad > 0:  # wrap around, like DistributedSampler (drop_last=False)
            order += order[:pad]
            pad = self.total - len(order)
        mine = order[self.dp_rank : self.total : self.dp_world]
        with self._lock:
            self._cached_epoch, self._cached = epoch, mine
        return mine

    def batch_indices(self, epoch: int, step: int) -> list[int]:
        """Indices of batch ``step`` of ``epoch``; ``IndexError`` past the end of the epoch."""
        if not 0 <= step < self.num_batches():
            raise IndexError(f"step {step} outside epoch of {self.num_batches()} batches")
        mine = self.rank_indices(epoch)
        return mine[step * self.batch_size : (step + 1) * self.batch_size]
