"""The user's own data loader, resumable at the exact batch (``Checkpointless(loader=...)``).

Users hand the runtime the loader they already have: a ``torch.utils.data.DataLoader``
(any sampler, ``DistributedSampler`` included, with or without workers), torchdata's
``StatefulDataLoader``, or ``dataloader_cache.CachedLoader``, and keep iterating their
own object (``for batch in data``). Two things stand in the way of an exact resume:

- a plain ``DataLoader`` has no state: a new iterator starts its pass from the first
  batch, and creating one draws seeds from the global torch generator (the shuffle of a
  ``RandomSampler``, the workers' base seed);
- an iterator the loop already holds runs ahead of a rollback: after a recovery to step
  ``C`` the loop's ``for batch in data`` would go on with the batch after the failed step.

So the runtime *tracks* the object (ADR 0031): its class is swapped, once, for a subclass
that differs only in ``__iter__``, which returns a :class:`_TrackedIterator`. The
:class:`LoaderPosition` registered in the training state in the loader's place holds the
pass (how many iterators were opened), the batches this pass handed out, the torch RNG
state the pass's iterator was created from, and the loader's own state when it has one.
After a restore, every tracked iterator re-opens at the restored position on its next
``next()``: from the creation RNG state (same shuffle, same worker seeds), skipping the
batches already consumed (index-only for a single-process map-style loader, by fetching
otherwise, which also replays the workers' own random streams), or, for a loader with
its own state, from that state.

A rollback into an *earlier pass* cannot be replayed by a loop that owns its epochs (the
code between two passes, and the loop's epoch variable, are the script's): the next
``next()`` then stops the job with one line saying to drive epochs with
``cl.epochs(...)`` (:mod:`recovery.runtime.epoch_loop`, which makes such rollbacks impossible).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, IterableDataset

from recovery.common.errors import RecoveryImpossible
from recovery.loader import hosted_loader
from replication.training_state.state import StateRegistrationError

#: Classes of the loaders this module accepts without a ``state_dict`` of their own.
ACCEPTED = ("a torch.utils.data.DataLoader, torchdata's StatefulDataLoader or "
            "dataloader_cache.CachedLoader")


class PassHooks(Protocol):
    """What the loop driving the passes does when a new pass begins (see epoch_loop)."""

    def before_pass(self) -> None: ...


class _NoHooks:
    def before_pass(self) -> None:
        pass


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None))


def skip(loader: Any, iterator: Any, n: int) -> None:
    """Advance a fresh iterator of ``loader`` by ``n`` batches.

    A single-process iterator over a map-style dataset only advances its index sampler
    (no data is loaded, no random number drawn); anything else fetches and drops the
    batches (workers replay their own random streams in the same order).
    """
    from torch.utils.data.dataloader import _SingleProcessDataLoaderIter

    sampler_iter = getattr(iterator, "_sampler_iter", None)
    if (isinstance(iterator, _SingleProcessDataLoaderIter) and sampler_iter is not None
            and not isinstance(getattr(loader, "dataset", None), IterableDataset)):
        for _ in range(n):
            next(sampler_iter)
        iterator._num_yielded += n
        return
    for _ in range(n):
        next(iterator)


def open_from(create: Any, creation_rng: Any) -> tuple[Iterator[Any], torch.Tensor]:
    """``create()`` an iterator with the torch generator at ``creation_rng`` (a pass
    resumed: the same shuffle and worker seeds), or at its current state; the global
    generator is left as it was. Returns the iterator and the state it was created from."""
    if not isinstance(creation_rng, torch.Tensor):
        creation = torch.get_rng_state()
        return create(), creation
    current = torch.get_rng_state()
    torch.set_rng_state(creation_rng)
    try:
        return create(), creation_rng
    finally:
        torch.set_rng_state(current)


def refusal(obj: Any) -> str:
    """The one line that says why ``obj`` cannot be the loader, and the fix (other
    entries are refused by :meth:`TrainingState.register`, which names theirs)."""
    kind = type(obj).__qualname__
    return (f"state 'loader' ({kind}) has no state_dict/load_state_dict and is not "
            f"{ACCEPTED}: pass one of those (e.g. DataLoader(dataset, batch_size=..., "
            f"sampler=DistributedSampler(dataset))), or give {kind} state_dict() and "
            "load_state_dict() that save and restore its position")


class LoaderPosition:
    """The training-state entry of a tracked loader (see the module docstring)."""

    def __init__(self, loader: Any, base: type) -> None:
        self.loader, self.base = loader, base
        # Its own state puts a CachedLoader back exactly. A StatefulDataLoader's own
        # state resumes its sampler but not its workers' random streams (a random
        # augmentation differs after a resume): it is replayed like a plain DataLoader.
        self.native = is_stateful(loader) and not isinstance(loader, DataLoader)
        self.hooks: PassHooks = _NoHooks()
        self.passes = 0  # iterators opened so far
        self.yielded = 0  # batches the current pass handed out
        self.creation_rng: torch.Tensor | None = None
        self.generation = 0  # bumped by every restore: older iterators re-open
        self._resume: dict[str, Any] | None = None
        self._begun = False  # the next pass was begun ahead of its first next()
        self.hosted: hosted_loader.Hosting | None = None  # see host()

    def host(self, ranks: tuple[int, ...], configured: int) -> None:
        """Hand out, per step, the batches the configured world's ``ranks`` would get,
        joined into one (the job shrank: :mod:`recovery.loader.hosted_loader`)."""
        if not self.native:
            self.hosted = hosted_loader.Hosting(self.loader, ranks, configured,
                                                why_not=self.split_refusal())
            return
        # a loader that keeps its own position (a CachedLoader) joins the ranks itself
        if (why := self.split_refusal()) is not None:
            raise hosted_loader.cannot_host(ranks, why)
        self.loader.host(ranks, configured, hosted_loader.concat)

    def split_refusal(self) -> str | None:
        """Why this loader cannot hand out other ranks' batches, or None if it can."""
        if self.native:
            own = getattr(self.loader, "host_refusal", None)
            if callable(own):
                return own()
            return (f"its loader ({type(self.loader).__qualname__}) keeps a position of its "
                    "own, which cannot be split by rank")
        return hosted_loader.refusal(self.loader)

    # -- the training state ----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"passes": self.passes, "yielded": self.yielded}
        if self.creation_rng is not None:
            state["creation_rng"] = self.creation_rng
        if self.native:
            state["inner"] = self.loader.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        yielded = state.get("yielded")
        if not isinstance(yielded, int) or yielded < 0:
            raise ValueError(f"loader position: 'yielded' must be a count, got {yielded!r}")
        if self.native and "inner" in state:
            self.loader.load_state_dict(state["inner"])
        self.passes = int(state.get("passes", 0))
        self.yielded = yielded
        self.creation_rng = state.get("creation_rng")
        self._resume = {"yielded": yielded, "creation_rng": self.creation_rng}
        self._begun = False
        self.generation += 1

    # -- passes ----------------------------------------------------------------------
    def begin_pass(self) -> int:
        """A new pass starts (its first ``next()``): the loop may snapshot the boundary
        first, with this pass's start as the position. Returns the pass number.

        After a restore no iterator re-opened yet (a replacement's first iterator), the
        new iterator continues the restored pass instead."""
        if self._resume is not None:
            return self.passes
        if self._begun:  # begin_ahead() did it, the boundary was snapshotted then
            self._begun = False
            return self.passes
        self.passes += 1
        self.yielded, self.creation_rng, self._resume = 0, None, None
        self.hooks.before_pass()
        return self.passes

    def begin_ahead(self) -> None:
        """The loop opens its next pass of steps (``cl.steps``) while this loader's pass
        has handed out its last batch: the next pass over the loader begins now, before
        its first ``next()``, so the boundary's snapshot holds its start (as a pass that
        ``begin_pass`` opened does), not the end of the pass before. A replacement that
        restores it then opens the new pass instead of the exhausted one."""
        if self._resume is None and not self._begun and self.at_pass_end():
            self.passes += 1
            self.yielded, self.creation_rng, self._begun = 0, None, True

    def at_pass_end(self) -> bool:
        """Whether the current pass has handed out its last batch (False when the loader
        has no length: an ``IterableDataset`` without ``__len__``)."""
        try:
            length = self.hosted.length if self.hosted is not None else len(self.loader)
            return self.yielded >= length
        except TypeError:
            return False

    def open(self) -> Iterator[Any]:
        """The underlying iterator of the current pass, at the current position."""
        resume, self._resume = self._resume, None
        done = resume["yielded"] if resume else 0
        if self.native:  # its own state (just loaded, after a restore) puts it back
            self.yielded = done
            return self.base.__iter__(self.loader)
        if getattr(self.loader, "persistent_workers", False):
            self.loader._iterator = None  # a pass resumed needs fresh workers
        creation = resume["creation_rng"] if resume else None

        def create() -> Iterator[Any]:
            if self.hosted is not None:
                return self.hosted.open(self.loader, skip, done)
            iterator = self.base.__iter__(self.loader)
            if done:
                skip(self.loader, iterator, done)
            return iterator

        iterator, self.creation_rng = open_from(create, creation)
        self.yielded = done
        return iterator


class _TrackedIterator:
    """What ``iter(loader)`` returns for a tracked loader: opened on the first ``next()``
    (a loop calls ``sampler.set_epoch`` before), re-opened after every restore."""

    def __init__(self, position: LoaderPosition) -> None:
        self._p = position
        self._it: Iterator[Any] | None = None
        self._generation = -1
        self._pass = 0

    def __iter__(self) -> _TrackedIterator:
        return self

    def __next__(self) -> Any:
        p = self._p
        if self._it is None:
            self._pass = p.begin_pass()
            self._it, self._generation = p.open(), p.generation
        elif self._generation != p.generation:  # restored since: re-open there
            if p.passes == 0 and p.yielded == 0 and self._pass == 1:
                p.passes = 1  # the job's initial state, from before the first pass opened
            if p.passes != self._pass:
                raise RecoveryImpossible(
                    f"the recovery went back to pass {p.passes} over the loader while the "
                    f"loop is in pass {self._pass} (the rollback crossed an epoch "
                    "boundary), which a loop that runs its own epochs cannot replay: drive "
                    "them with `for epoch in cl.epochs(N):` and wrap each step in "
                    "`with cl.training_step():`")
            self._it, self._generation = p.open(), p.generation
        batch = next(self._it)
        p.yielded += 1
        return batch


_TRACKED: dict[type, type] = {}


def _tracked_class(cls: type) -> type:
    """A subclass of ``cls`` whose only change is ``__iter__`` (made once per class)."""
    if cls not in _TRACKED:
        def __iter__(self: Any) -> Iterator[Any]:
            return _TrackedIterator(self._checkpointless_position)

        _TRACKED[cls] = type(cls.__name__, (cls,), {
            "__iter__": __iter__, "__module__": cls.__module__,
            "__qualname__": cls.__qualname__, "_checkpointless_tracked": True})
    return _TRACKED[cls]


def _accepted(loader: Any) -> bool:
    if isinstance(loader, DataLoader):  # StatefulDataLoader is one too
        return True
    from dataloader_cache.loader import CachedLoader

    return isinstance(loader, CachedLoader)


def track(loader: Any) -> Any:
    """What ``Checkpointless(loader=...)`` registers for ``loader``: a
    :class:`LoaderPosition` for an accepted loader (whose class becomes tracked), the
    object itself for any other object with ``state_dict``/``load_state_dict``.
    Raises :class:`StateRegistrationError` with the fix otherwise."""
    if getattr(type(loader), "_checkpointless_tracked", False):
        return loader._checkpointless_position  # registered again (a second runtime)
    if not _accepted(loader):
        if is_stateful(loader):
            return loader
        raise StateRegistrationError(refusal(loader))
    cls = type(loader)
    position = LoaderPosition(loader, cls)
    loader._checkpointless_position = position
    loader.__class__ = _tracked_class(cls)
    return position


def mark_committed(state: Any) -> None:
    """Let cached loaders evict batches older than the snapshot just taken.

    The snapshot commits a moment later, in the background; loaders keep a lookback
    window (``dataloader_cache.lookback`` batches) behind the mark, which covers the
    rollback to the previous commit if this one never completes.
    """
    for _, obj in state:
        mark = getattr(obj, "mark_committed", None)
        if callable(mark):
            mark()
