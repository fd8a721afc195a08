"""A DDP communication hook that stops waiting as soon as a failure is declared.

DDP waits for its gradient all-reduce inside the autograd engine, with the process
group's timeout. When a peer dies, the ranks that talk to it directly fail fast (its
sockets close), but a rank whose ring neighbours are alive can wait for data a failed
survivor will never send: up to ``recovery.collective_timeout_s``. The hook returns a
future of its own that completes with the all-reduce, or with an error the moment the
runtime's watchdog sees a new generation, so ``backward`` raises and the strategy
recovers. By default the gradients are averaged with :func:`ordered_mean`, which is
bit-reproducible across the DDP rebuild a recovery does; ``deterministic=False`` on the
strategy uses DDP's own all-reduce arithmetic (:func:`allreduce_mean`) instead.

(No ``from __future__ import annotations`` here: DDP checks the hook's annotations.)
"""

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from recovery.errors import FailureDetected


def allreduce_mean(_state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default: divide by the world size, then all-reduce (sum) in place."""
    tensor = bucket.buffer()
    tensor.div_(dist.get_world_size())
    fut = dist.all_reduce(tensor, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def ordered_mean(_state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The mean of every rank's gradients, summed in rank order: bit-reproducible.

    A ring all-reduce adds the ranks' values in an order that depends on where an element
    sits in the bucket (its chunk of the ring), and DDP lays its buckets out anew after
    the first iteration of every new ``DistributedDataParallel``, which is what a
    recovery builds. With three or more ranks the last bits then differ from a run
    without failures. Gathering every rank's bucket and adding them in rank order makes
    each element's sum independent of the layout, for about twice the traffic.
    """
    tensor = bucket.buffer()
    world = dist.get_world_size()
    if world <= 2:  # a + b == b + a: the ring order cannot change the result
        return allreduce_mean(_state, bucket)
    parts = [torch.empty_like(tensor) for _ in range(world)]
    fut = dist.all_gather(parts, tensor, async_op=True).get_future()

    def add_in_rank_order(done: torch.futures.Future) -> torch.Tensor:
        done.wait()  # re-raises the all-gather's error (a peer died)
        tensor.copy_(parts[0])
        for part in parts[1:]:
            tensor.add_(part)
        return tensor.div_(world)

    return fut.then(add_in_rank_order)


class FailureAwareHook:
    """Wraps a comm hook (DDP's default all-reduce unless given) with a failure exit."""

    def __init__(
        self,
        should_abort: Callable[[], bool],
        inner: Callable[[Any, Any], torch.futures.Future] | None = None,
        poll_s: float = 0.02,
    ) -> None:
        self.__name__ = self.__qualname__ = "checkpointless_failure_aware_hook"  # DDP logs it
        self._should_abort = should_abort
        self._inner = inner or ordered_mean
        self._poll_s = poll_s
        self._lock = threading.Lock()
        self._pending: set[torch.futures.Future] = set()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def __call__(self, state: object,
                 bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        inner = self._inner(state, bucket)
        out: torch.futures.Future = torch.futures.Future()
        with self._lock:
            self._pending.add(out)
        inner.add_done_callback(lambda f: self._complete(out, f))
        self._ensure_watcher()
        return out

    def _complete(self, out: torch.futures.Future, inner: torch.futures.Future) -> None:
        with self._lock:
            if out not in self._pending:
                return  # already failed by the watcher
            self._pending.discard(out)
        try:
            out.set_result(inner.value())
        except Exception as exc:  # the all-reduce itself failed (a peer's socket closed)
            out.set_exception(FailureDetected(f"gradient all-reduce failed: {exc}"))

    def _ensure_watcher(self) -> None:
        self._wake.set()
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, daemon=True,
                                            name="checkpointless-ddp-watch")
            self._thread.start()

    def _watch(self) -> None:
        while not self._closed:
            self._wake.wait()
            with self._lock:
                if not self._pending:
                    self._wake.clear()
                    continue
            if self._should_abort():
                with self._lock:
                    doomed, self._pending = self._pending, set()
                for out in doomed:
                    out.set_exception(FailureDetected(
                        "a failure was declared while DDP waited for its gradient all-reduce"))
            else:
                time.sleep(self._poll_s)

    def close(self) -> None:
        """Stop watching; futures still pending are failed (their DDP is being dropped)."""
        self._closed = True
        with self._lock:
            doomed, self._pending = self._pending, set()
        for out in doomed:
            out.set_exception(FailureDetected("DDP of an abandoned generation"))
        self._wake.set()
