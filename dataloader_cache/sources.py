"""Batch production from the user's dataset: ``compute(epoch, step) -> batch``.

Two sources, one contract. :class:`MapSource` is random access (indices come from the
:class:`~dataloader_cache.sampler.DeterministicSampler`), so any step can be built at any
time by any thread or process. :class:`IterableSource` can only walk its stream forward:
element ``i`` of epoch ``e`` goes to data-parallel rank ``i % dp_world``, and batch ``k``
of a rank is its ``k``-th group of ``batch_size`` elements. Reaching step ``k`` after a
restart therefore means re-reading (and re-preprocessing, if ``__iter__`` preprocesses)
``k * batch_size * dp_world`` elements from the start of the epoch: the replay cost is
linear in the position. The node cache hides that cost for every step it still holds;
the replay only happens, in the background, for the first step it does not.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .epoch_cache import EpochSampleCache
from .sampler import DeterministicSampler
from .stats import Counters

END = object()
"""Returned by :meth:`IterableSource.compute` past the end of the epoch's stream."""


class MapSource:
    """Builds batches of a map-style dataset, reading samples through the epoch cache."""

    sequential = False

    def __init__(
        self,
        dataset: Any,
        sampler: DeterministicSampler,
        collate_fn: Callable[[list[Any]], Any],
        epoch_cache: EpochSampleCache | None,
        counters: Counters,
    ) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.collate_fn = collate_fn
        self.epoch_cache = epoch_cache
        self.counters = counters

    def num_batches(self) -> int | None:
        """Batches per epoch for this rank."""
        return self.sampler.num_batches()

    def sample(self, index: int) -> Any:
        """``dataset[index]``, from the epoch cache when it holds it."""
        ec = self.epoch_cache
        if ec is not None:
            found, value = ec.get(index)
            if found:
                return value
        value = self.dataset[index]
        self.counters.add("samples_loaded")
        if ec is not None:
            ec.put(index, value)
        return value

    def compute(self, epoch: int, step: int) -> Any:
        """The collated batch ``step`` of ``epoch`` for this rank."""
        indices = self.sampler.batch_indices(epoch, step)
        return self.collate_fn([self.sample(i) for i in indices])


class IterableSource:
    """Batches of an iterable dataset, sharded round-robin, positioned by replay.

    Only one thread may drive it at a time (the loader gives it a single worker), and it
    is fastest when asked for steps in increasing order, which is what prefetch does.
    """

    sequential = True

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        collate_fn: Callable[[list[Any]], Any],
        counters: Counters,
        *,
        dp_rank: int = 0,
        dp_world: int = 1,
        drop_last: bool = False,
    ) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.counters = counters
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.drop_last = drop_last
        self._lock = threading.Lock()
        self._it: Iterator[Any] | None = None
        self._epoch = -1
        self._pos = 0  # next step the live iterator would produce
        self._end: dict[int, int] = {}  # epoch -> first step past the end

    def num_batches(self) -> int | None:
        """Unknown until the stream ends."""
        return None

    def _restart(self, epoch: int) -> None:
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        self._it = iter(self.dataset)
        self._epoch = epoch
        self._pos = 0

    def _chunk(self) -> list[Any] | None:
        """The next ``batch_size * dp_world`` elements, or ``None`` if the stream ended."""
        assert self._it is not None
        n = self.batch_size * self.dp_world
        chunk = list(itertools.islice(self._it, n))
        self.counters.add("samples_loaded", len(chunk))
        full = len(chunk) == n
        # a short tail is a step only if every rank gets at least one element of it
        # (unequal step counts across ranks would hang the collectives)
        if full or (not self.drop_last and len(chunk) >= self.dp_world):
            return chunk
        return None

    def compute(self, epoch: int, step: int) -> Any:
        """Batch ``step`` of ``epoch`` for this rank, or :data:`END`."""
        with self._lock:
            end = self._end.get(epoch)
            if end is not None and step >= end:
                return END
            if self._it is None or self._epoch != epoch or self._pos > step:
                self._restart(epoch)
            while self._pos <= step:
                chunk = self._chunk()
                if chunk is None:
                    self._end[epoch] = self._pos
                    self._it = None
                    return END
                self._pos += 1
            mine = chunk[self.dp_rank :: self.dp_world]
            if len(mine) < self.batch_size:  # the tail was short: nothing follows it
                self._end[epoch] = self._pos
                self._it = None
            return self.collate_fn(mine)
