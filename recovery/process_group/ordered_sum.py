"""A floating-point all-reduce whose every element adds the ranks in rank order, at a
ring's traffic (``recovery.ordered_allreduce``, opt-in; ADR 0034).

A backend's all-reduce adds an element's values in an order set by where the element
sits in its buffer. Code whose buffers are laid out differently after a recovery than
in the failure-free run (a bucketing of its own that a recovery resets) gets last-bit
differences with three or more ranks. DDP's layout is carried with the state instead
(:mod:`recovery.process_group.ddp_layout`); this is for what is left.

The sum is a reduce-scatter in rank order followed by an all-gather:

1. the tensor is cut into N chunks and an all-to-all gives rank ``c`` every rank's
   chunk ``c``;
2. rank ``c`` adds them in rank order, 0 to N-1, whatever the buffer's layout;
3. an all-gather gives every rank every reduced chunk.

Each rank sends 2(N-1)/N of the tensor, as a ring does (the all-gather-then-add it
replaces sent (N-1)x and held N copies), and holds about 1 + 1/N extra copies.

The two phases are two collectives, and the second can only be issued once the first
has ended, off the caller's thread. If it went on the group's own inner backend, a
collective the caller issues meanwhile could get ahead of it on one rank and not on
another, and the ranks would pair different collectives. So ordered sums run on an
inner backend of their own (a *lane*, built with the generation), one after the other
in the order the caller issued them, by one thread: the same order on every rank.

The lane runs wherever the inner backend is gloo, CPU or CUDA tensors. For CUDA ones
the lane thread's stream first waits on where the caller's stream stood when it
submitted the sum (:func:`issue_point`): the tensor may still be being written by the
caller's kernels. The lane's gloo works' ``wait()`` order the lane's stream after each
phase, and the group's device-aware future orders the caller's after the lane's.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch._C._distributed_c10d import AllgatherOptions, AllToAllOptions

LANE_SUFFIX = "/ordered"
"""The key of a device's ordered lane among a group's inner backends (``cpu/ordered``)."""

Issue = Callable[[Callable[[], Any]], Any]
"""Issues one inner collective for an operation still pending, and returns its work
(raising if the operation was failed meanwhile): the group's bookkeeping, so a failure
declared mid-sum waits for, and never frees under, a collective in flight."""


def issue_point(tensor: torch.Tensor) -> Any:
    """A CUDA event on the caller's current stream for ``tensor``'s device, or None for
    a tensor off CUDA: what the lane's stream waits on before reading the tensor."""
    if not tensor.is_cuda:
        return None
    return torch.cuda.current_stream(tensor.device).record_event()


def rank_ordered_sum(backend: Any, tensor: torch.Tensor, size: int, issue: Issue,
                     ready: Any = None) -> None:
    """Sum ``tensor`` over the ``size`` ranks of ``backend`` in rank order, in place.

    ``ready``, from :func:`issue_point`, is waited on by this thread's current stream
    first (CUDA tensors)."""
    if ready is not None:
        torch.cuda.current_stream(tensor.device).wait_event(ready)
    flat = tensor.detach().reshape(-1)
    numel = flat.numel()
    chunk = -(-numel // size)
    whole = flat.is_contiguous() and numel == chunk * size and flat.data_ptr() == \
        tensor.data_ptr()
    send = flat if whole else flat.new_zeros(chunk * size)
    if not whole:
        send[:numel].copy_(flat)
    received = torch.empty_like(send)
    issue(lambda: backend.alltoall_base(received, send, [], [], AllToAllOptions())).wait()
    rows = received.view(size, chunk)
    mine = rows[0].clone()
    for row in rows[1:]:
        mine.add_(row)
    out = send if whole else torch.empty_like(send)  # the input was consumed by phase 1
    issue(lambda: backend._allgather_base(out, mine, AllgatherOptions())).wait()
    if not whole:
        flat.copy_(out[:numel])
        if flat.data_ptr() != tensor.data_ptr():  # a non-contiguous tensor: reshape copied
            tensor.copy_(flat.view_as(tensor))


class SerialLane:
    """One thread that runs ordered sums in the order they were submitted."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        self._queue.put(job)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name,
                                                daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            job()  # never raises: each job finishes its own operation, error or not
            del job
