"""Overlapped capture: copying optimizer-owned tensors while the loop goes on (ADR 0013).

The large tensors that only ``optimizer.step()`` changes need not stall the training
loop: a capture leaves them to a :class:`PendingCopy`, which the replication round
advances on a thread at the lowest CPU priority (:func:`run_niced`) while the loop runs
the next forward and backward pass. The copy must end before anything changes those
tensors, so an optimizer step pre-hook (:func:`_fence_before_step`) and a restore guard
(:func:`_weak_fence`) fence it, and a tensor changed anyway is caught as a torn
snapshot (:class:`SnapshotTorn`). Which tensors to defer, and when to fence, is decided
by the engine (:class:`replication.snapshots.snapshot.SnapshotEngine`); this module is the
machinery it uses.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import torch

from replication.snapshots.digest_copy import copy_and_digest_steps
from replication.snapshots.slots import SnapshotSlot
from replication.training_state.layout import FlatState, SnapshotLayout
from replication.training_state.snapshot_meta import SnapshotError
from replication.training_state.state import TrainingState, local_tensor

if TYPE_CHECKING:
    from replication.snapshots.snapshot import SnapshotEngine


class SnapshotTorn(SnapshotError):
    """A tensor changed while an overlapped capture was copying it (see :class:`PendingCopy`)."""


DEFER_MIN_BYTES = 64 << 10
"""By default an overlapped capture leaves optimizer-owned tensors at least this large
to :class:`PendingCopy`; smaller ones are copied at once (few bytes, many calls)."""


class PendingCopy:
    """The part of an overlapped capture copied after :meth:`SnapshotEngine.capture` returns.

    It holds the large tensors owned by the state's optimizers (their parameters and
    their state, such as Adam's moments), which nothing but ``optimizer.step()``
    changes, so they can be copied while the loop runs the next forward and backward
    pass. The copy (with the checksum, in one pass) advances one chunk at a time
    (:func:`copy_and_digest_steps`), under a lock, by whichever thread runs it:
    normally the round, on a thread at the lowest priority (``run(background=True)``);
    otherwise the training thread at the engine's fence, before the next optimizer step
    or restore. A fence that finds the copy unfinished takes it over: the background
    thread gives it up at its next chunk boundary, so a starved low-priority thread
    holds the loop up for one chunk at most, never for the rest of the copy.

    Each tensor's version counter (which torch bumps on every in-place change it sees,
    once the change is done) is recorded at capture. A tensor changed before the copy
    finished makes a torn snapshot: :meth:`run` then raises :class:`SnapshotTorn`, so
    the step is never committed. The check is best-effort: a change still running when
    the copy ends is only seen at the next fence, after the step may have committed,
    and changes through ``.data`` are never seen (ADR 0013).
    """

    def __init__(
        self, slot: SnapshotSlot, flat: FlatState, deferred: list[int], *, streaming: bool
    ) -> None:
        self.slot = slot
        self.step = slot.step
        already = frozenset(range(len(flat.tensors))).difference(deferred)
        self._steps: Generator[None, None, dict[str, str]] | None = copy_and_digest_steps(
            slot, flat, streaming=streaming, already_copied=already)
        self._watched = [(i, flat.tensors[i], flat.tensors[i]._version) for i in deferred]
        self._turn = threading.Lock()  # held by the thread advancing the copy
        self._wanted = threading.Event()  # a foreground caller is waiting for the copy
        self.done = threading.Event()
        self.digests: dict[str, str] | None = None
        self.error: BaseException | None = None

    @property
    def nbytes(self) -> int:
        """Bytes copied off the training thread."""
        return sum(t.numel() * t.element_size() for _, t, _ in self._watched)

    def run(self, *, background: bool = False) -> dict[str, str] | None:
        """Do the copy, or what is left of it, and return the digests.

        ``background=True`` gives the copy up, returning ``None``, as soon as a
        foreground caller wants it; a foreground call returns once the copy is done
        (by whichever thread), and raises its error if it failed or is torn.
        """
        if not background:
            self._wanted.set()
        while not self.done.is_set():
            if background and self._wanted.is_set():
                return None
            with self._turn:
                if not self.done.is_set():
                    self._advance(yield_when_wanted=background)
        if self.error is not None:
            raise self.error
        return self.digests

    def _advance(self, *, yield_when_wanted: bool) -> None:
        """Copy chunks until the copy is done (or, with ``yield_when_wanted``, until a
        foreground caller asks for it). Holds ``_turn``."""
        assert self._steps is not None
        try:
            while not (yield_when_wanted and self._wanted.is_set()):
                next(self._steps)
        except StopIteration as finished:
            changed = self.changed()
            if changed:
                self.error = SnapshotTorn(
                    f"snapshot of step {self.step} is torn: {', '.join(changed[:3])} "
                    "changed in place while being copied, outside optimizer.step(). "
                    "Overlapped copies are now off for this run; to keep them off from "
                    "the start, set replication.overlap_copy=false"
                )
            else:
                self.digests = finished.value
            self._finish()
        except BaseException as exc:
            self.error = exc
            self._finish()

    def _finish(self) -> None:
        self._steps = None  # it refers to the live tensors: no reference kept
        self.done.set()

    def changed(self) -> list[str]:
        """The tensors whose version changed since the capture, described for messages."""
        layout = self.slot.layout
        assert layout is not None
        out = []
        for i, t, version in self._watched:
            if t._version != version:
                out.append(_describe_tensor(layout, i))
        return out


def _describe_tensor(layout: SnapshotLayout, index: int) -> str:
    """``state entry 'optim', tensor #3 (float32[2048, 2048])`` for tensor ``index``."""
    for seg in layout.segments:
        if index < len(seg.tensors):
            spec = seg.tensors[index]
            return f"state entry {seg.name!r}, tensor #{index} ({spec.dtype}{list(spec.shape)})"
        index -= len(seg.tensors)
    return f"tensor #{index}"


def _optimizer_owned(state: TrainingState) -> tuple[list[torch.optim.Optimizer], set[int]]:
    """The state's torch optimizers (registered or declared), and the addresses of the
    host tensors they own (parameters and per-parameter state): what only their
    ``step()`` changes."""
    optimizers = state.optimizers()
    owned: set[int] = set()
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                owned.add(local_tensor(p.detach()).data_ptr())
        for per_param in opt.state.values():
            for value in per_param.values():
                if isinstance(value, torch.Tensor):
                    owned.add(local_tensor(value.detach()).data_ptr())
    return optimizers, owned


def _fence_before_step(
    engine_ref: weakref.ReferenceType[SnapshotEngine],
    _optimizer: torch.optim.Optimizer,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """An optimizer step pre-hook: fence the engine's pending copy before any update.

    A step given a closure runs the forward and backward pass inside ``step()``
    (Lightning's automatic optimization does), after this hook: the closure is wrapped
    so that the fence comes after it, right before the update, and the copy still
    overlaps the forward and backward pass.
    """
    engine = engine_ref()
    if engine is None or (engine.pending is None
                          and all(slot.copy_done is None for slot in engine.slots)):
        return None
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if not callable(closure):
        engine.fence()
        return None

    def fenced_closure() -> Any:
        result = closure()
        engine.fence()
        return result

    if "closure" in kwargs:
        return args, {**kwargs, "closure": fenced_closure}
    return (args[0], fenced_closure, *args[2:]), kwargs


COPY_NICE = 19
"""The nice value of the thread that does an overlapped copy (the lowest priority)."""


def run_niced(fn: Callable[[], Any]) -> None:
    """Run ``fn`` on a new thread at nice :data:`COPY_NICE` and wait for it; its result
    and any exception are dropped (:meth:`PendingCopy.run` keeps them).

    An overlapped copy competes with the training step for cores. Where a core is idle
    (most GPU hosts) the scheduler runs it there at once; where every core is busy (the
    2-core CI host, two ranks) it takes only the step's idle moments, such as waits in
    collectives, and the rest when the optimizer step's fence blocks the training thread
    on it. Measured in ``bench_snapshot``: ADR 0013. Linux sets nice per thread; a
    fresh thread may always lower its own priority, so no privilege is needed, and the
    thread ends with the copy, so nothing has to raise it again. Elsewhere the call
    fails and the copy runs at normal priority.
    """

    def body() -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COPY_NICE)
        with contextlib.suppress(BaseException):
            fn()

    worker = threading.Thread(target=body, name="checkpointless-copy", daemon=True)
    worker.start()
    worker.join()


def _weak_fence(engine: SnapshotEngine) -> Callable[[], None]:
    """``engine.fence`` without keeping the engine alive (a restore guard on its state)."""
    ref = weakref.ref(engine)

    def guard() -> None:
        live = ref()
        if live is not None:
            live.fence()

    return guard
