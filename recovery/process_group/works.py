"""The works :class:`~recovery.process_group.owned_group.ElasticProcessGroup` hands out, failable
at will.

A declared failure must end every wait on a collective at once, whoever waits
(``work.wait()``, DDP's bucket future, a blocking ``dist.broadcast``), even when the
inner backend never answers. So the owned group never hands out the inner backend's
work: it hands out a :class:`_Work` over a future of its own (:class:`_Op`), which the
group completes when the inner work does, or fails with :class:`CollectiveAborted`
when a failure is declared. The ways torch's own futures and works misbehave when
failed from Python are why these classes look the way they do (see each docstring).

For CUDA tensors, "the inner work is done" is not "the result is there": NCCL's future
completes once its kernel is enqueued, and gloo's once its copy back to the device is
enqueued on a side stream. What orders the caller's stream after the collective is the
inner work's own ``wait()``, and CUDA events recorded in a device-aware future. So
:meth:`_Work.wait` also waits on the inner work once ours succeeded (never before: a
declared failure must still end the wait at once), and an operation on CUDA tensors
hands out a future made with their devices, completed from within the inner future's
callback, whose streams have waited on the inner work's.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import torch
import torch.distributed as dist

from recovery.common.errors import CollectiveAborted, FailureDetected


def _unwrap(trigger: torch.futures.Future) -> Any:
    ok, value = trigger.value()
    if not ok:
        raise value
    return value


class _Op:
    """One collective in flight: the work we handed out and the inner work behind it.

    ``future`` is a ``then`` child of a private trigger: completing the trigger with an
    error makes the callback raise, which fails ``future`` in C++ terms. (Python's
    ``Future.set_exception`` would instead store the exception as the *result*, which
    DDP's reducer then reads as its gradient bucket: a segfault in torch 2.13.)

    ``devices`` (the CUDA devices of the operation's tensors; none for CPU ones) makes
    both futures device-aware: completing the trigger records CUDA events on the
    current streams, and whoever waits on ``future`` (or chains on it, as DDP's reducer
    does) has its own streams wait on them. The group completes the trigger from the
    inner future's callback, whose current streams already wait on the inner work's.

    ``settle`` is the inner work whose ``wait()`` the caller's :meth:`_Work.wait` makes
    once the operation succeeded (see the module doc); it is dropped when the operation
    fails, so a failed generation's backend is not kept alive by a work a caller holds.
    """

    __slots__ = ("done", "error", "future", "inner", "lock", "settle", "trigger")

    def __init__(self, devices: list[torch.device] | None = None) -> None:
        self.trigger: torch.futures.Future = torch.futures.Future(devices=devices)
        self.future: torch.futures.Future = self.trigger.then(_unwrap)
        self.inner: Any = None
        self.settle: Any = None
        self.lock = threading.Lock()
        self.done = False
        self.error: BaseException | None = None

    def hold(self, work: Any) -> None:
        """Keep ``work`` for :meth:`_Work.wait`, unless the operation already failed."""
        with self.lock:
            if self.error is None:
                self.settle = work

    def finish(self, value: Any = None, error: BaseException | None = None) -> bool:
        with self.lock:
            if self.done:
                return False
            self.done = True
            self.error = error
            if error is not None:
                self.settle = None
        self.trigger.set_result((error is None, error if error is not None else value))
        return True


class _Work(dist.Work):
    """The work handed to callers: its future is ours, so it can be failed at will.

    (``torch._C._distributed_c10d._create_work_from_future`` would be shorter, but its
    ``wait()`` returns normally on a failed future: a blocking ``dist.all_reduce``
    would then succeed silently with the tensor unreduced. Measured on torch 2.13.)
    """

    def __init__(self, op: _Op) -> None:
        super().__init__()
        self._op = op
        self._future = op.future

    def wait(self, timeout: Any = None) -> bool:
        """Our future first (a declared failure ends it at once, whatever the inner
        backend does), then the inner work's own ``wait()``: what makes the caller's
        current CUDA stream wait on NCCL's, or on gloo's copy back to the device. It is
        only reached once the inner future completed: gloo's work has then ended, and
        NCCL's ``wait()`` only orders streams (with ``TORCH_NCCL_BLOCKING_WAIT`` it
        blocks, until the abort that a declared failure makes ends it)."""
        try:
            self._future.wait()
        except Exception:
            if self._op.error is not None:  # the error itself, not torch's wrapping of it
                raise self._op.error from None
            raise
        settle = self._op.settle
        if settle is not None:
            try:
                settle.wait()
            except RuntimeError as exc:  # the generation was aborted meanwhile
                raise _as_failure(exc) from exc
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:
            return False
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def result(self) -> Any:
        self.wait()
        return self._future.value()


def _completed(value: Any) -> Any:
    op = _Op()
    op.finish(value)
    return _Work(op)


class _WorkWaiter:
    """Futures for inner works that have none (gloo's ``_reduce_scatter_base``): one
    thread per group waits on each in turn, in issue order, as the backend runs them."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Any, torch.futures.Future]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def watch(self, work: Any) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        self._queue.put((work, fut))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name,
                                                daemon=True)
                self._thread.start()
        return fut

    def _loop(self) -> None:
        while True:
            work, fut = self._queue.get()
            try:
                work.wait()  # an aborted generation's work ends at once (sockets shut)
            except Exception as exc:
                fut.set_exception(exc)
            else:
                fut.set_result(None)
            del work, fut


def _as_failure(exc: BaseException) -> BaseException:
    """An inner backend's error (a peer's socket closed) as a :class:`FailureDetected`."""
    if isinstance(exc, FailureDetected):
        return exc
    return CollectiveAborted(f"checkpointless: collective failed: {exc}")
