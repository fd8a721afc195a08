"""The training data loader, made resumable at the exact batch and used as the step clock.

Lightning restores stateful loaders (``state_dict``/``load_state_dict``) from a checkpoint,
but a plain ``DataLoader`` restarts its epoch from the first batch, and re-creating its
iterator draws a seed from the global torch generator (the sampler's shuffle and the
workers' base seed). :class:`ResumableLoader` wraps each training loader the strategy
sees (``Strategy.process_dataloader``, a public hook) and fixes both:

- its state is the number of batches this epoch's iterator handed out, the torch RNG
  state the iterator was created from, and the wrapped loader's own state if it has one;
- after a restore, the next iterator is created from that RNG state (same shuffle, same
  worker seeds) and skips the batches already consumed (index-only for a single-process
  map-style ``DataLoader``, by fetching otherwise), unless the wrapped loader is
  stateful itself, in which case its own state puts it back.

Iterators are created lazily, on the first ``next()``: Lightning creates the epoch's
iterator before it calls ``set_epoch`` on the sampler. And every ``next()`` first calls
``hooks.before_fetch(first)``: the moment just before a training batch is fetched is the
step boundary at which the strategy snapshots (the previous step, its optimizer step,
validation and loop bookkeeping are all done by then).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from recovery.loader import hosted_loader
from recovery.loader.loader_position import is_stateful as _stateful
from recovery.loader.loader_position import open_from, skip

_OWN = frozenset({"_inner", "_hooks", "_yielded", "_creation_rng", "_resume", "_hosted"})


class LoaderHooks(Protocol):
    def before_fetch(self, first: bool) -> None: ...

    def after_iterator_created(self) -> None: ...

    def current_epoch(self) -> int: ...


class ResumableLoader:
    """A transparent wrapper of a training loader (attributes pass through)."""

    def __init__(self, inner: Any, hooks: LoaderHooks) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_hooks", hooks)
        object.__setattr__(self, "_yielded", 0)
        object.__setattr__(self, "_creation_rng", None)
        object.__setattr__(self, "_resume", None)
        object.__setattr__(self, "_hosted", None)

    def host(self, ranks: tuple[int, ...], configured: int) -> None:
        """Hand out, per step, the batches the configured world's ``ranks`` would get,
        joined (the job shrank: :mod:`recovery.loader.hosted_loader`)."""
        self._hosted = hosted_loader.Hosting(self._inner, ranks, configured)

    # -- transparency ------------------------------------------------------------------
    @property
    def inner(self) -> Any:
        return self._inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._inner, name, value)

    def __len__(self) -> int:
        if self._hosted is not None:  # the configured world's pass: as many steps
            return self._hosted.length
        return len(self._inner)

    def __repr__(self) -> str:
        return f"ResumableLoader({self._inner!r})"

    # -- state -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"yielded": self._yielded, "creation_rng": self._creation_rng}
        if _stateful(self._inner):
            state["inner"] = self._inner.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        yielded = state.get("yielded")
        if not isinstance(yielded, int) or yielded < 0:
            raise ValueError(f"resumable loader state: 'yielded' must be a count, got {yielded!r}")
        if "inner" in state:
            if not _stateful(self._inner):
                raise ValueError("resumable loader state holds the state of a stateful loader, "
                                 f"but the training loader is {type(self._inner).__name__}")
            self._inner.load_state_dict(state["inner"])
        self._resume = {"yielded": yielded, "creation_rng": state.get("creation_rng")}

    # -- iteration ---------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        return _LazyIterator(self)

    def _open(self) -> Iterator[Any]:
        resume, self._resume = self._resume, None
        done = resume["yielded"] if resume else 0

        def create() -> Iterator[Any]:
            set_epoch = getattr(self._inner, "set_epoch", None)
            if callable(set_epoch) and getattr(self._inner, "sampler", None) is None:
                set_epoch(self._hooks.current_epoch())  # loaders that own their sampling
            if self._hosted is not None:
                return self._hosted.open(self._inner, skip, done)
            iterator = iter(self._inner)
            if done and not _stateful(self._inner):
                skip(self._inner, iterator, done)
            return iterator

        iterator, self._creation_rng = open_from(create, resume["creation_rng"] if resume
                                                 else None)
        self._yielded = done
        return iterator


class _LazyIterator:
    def __init__(self, loader: ResumableLoader) -> None:
        self._loader = loader
        self._it: Iterator[Any] | None = None

    def __iter__(self) -> _LazyIterator:
        return self

    def __next__(self) -> Any:
        loader = self._loader
        first = self._it is None
        loader._hooks.before_fetch(first)
        if self._it is None:
            self._it = loader._open()
            loader._hooks.after_iterator_created()
        batch = next(self._it)
        loader._yielded += 1
        return batch
