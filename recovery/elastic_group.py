"""The process group everybody uses, owned by the runtime and valid across generations.

Third-party code (DDP's reducer, FSDP2, DeviceMesh, Lightning's broadcasts, the user's
own ``dist.*`` calls) holds on to the ``ProcessGroup`` object it was given and waits in
places the runtime cannot reach. So the runtime owns that object:
:class:`ElasticProcessGroup` is a ``torch.distributed.ProcessGroup`` (registered as the
``checkpointless`` backend, the way torch's own threaded test group is) that forwards
each collective to an *inner* backend of the current generation (gloo for CPU tensors,
NCCL for CUDA ones) and returns a work of its own. When a failure is declared
(:meth:`Controller.fail`, called by the watchdog the moment the store shows it):

1. every pending work fails at once with :class:`CollectiveAborted`, whoever waits on
   it (``work.wait()``, DDP's bucket future, a blocking ``dist.broadcast``);
2. the inner groups are aborted (gloo: their sockets are shut down,
   :mod:`replication.abortable_gloo`; NCCL: ``abort()``), so their own operations end
   and they can be destroyed at once: nothing of a failed generation keeps running;
3. new collectives raise at once until :meth:`Controller.activate` binds every group
   to the next generation's inner backends, created over the job store under
   ``cl/g{G}/pg/<group name>``.

A process that has not joined a generation yet (a replacement running its script's
set-up: ``init_process_group``, the DDP constructor's weight broadcast and shape
check) completes collectives *locally*: nobody else is there to answer, and all that
they could compute is overwritten by the state the replacement receives when it joins.
They are counted (``Controller.local_collectives``) and reported.

Under ``checkpointless run`` :func:`install_init_hook` makes
``torch.distributed.init_process_group`` build this group whatever backend the script
names ("gloo", "nccl", "cpu:gloo,cuda:nccl" or none), so scripts written for
``torchrun`` run unchanged. See ``docs/adr/0015-owned-process-group.md``.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import inspect
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)

from recovery.errors import CollectiveAborted, FailureDetected
from recovery.protocol import gen_prefix
from replication.abortable_gloo import AbortableGloo

BACKEND_NAME = "checkpointless"
_INNER_DEFAULT = {"cpu": "gloo", "cuda": "nccl"}


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
    """

    __slots__ = ("done", "error", "future", "inner", "lock", "trigger")

    def __init__(self) -> None:
        self.trigger: torch.futures.Future = torch.futures.Future()
        self.future: torch.futures.Future = self.trigger.then(_unwrap)
        self.inner: Any = None
        self.lock = threading.Lock()
        self.done = False
        self.error: BaseException | None = None

    def finish(self, value: Any = None, error: BaseException | None = None) -> bool:
        with self.lock:
            if self.done:
                return False
            self.done = True
            self.error = error
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
        try:
            self._future.wait()
        except Exception:
            if self._op.error is not None:  # the error itself, not torch's wrapping of it
                raise self._op.error from None
            raise
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
        return self._future.wait()


def _completed(value: Any) -> Any:
    op = _Op()
    op.finish(value)
    return _Work(op)


class _Inner:
    """A generation's inner backend for one device type, abortable."""

    def __init__(self, kind: str, backend: Any, gloo: AbortableGloo | None) -> None:
        self.kind = kind
        self.backend = backend
        self.gloo = gloo

    def abort(self) -> None:
        if self.gloo is not None:
            self.gloo.abort()
        else:  # pragma: no cover - NCCL needs GPUs (untested here)
            try:
                self.backend.abort()
            except Exception:
                pass


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


def _gathered_alone(outputs: list[list[torch.Tensor]],
                    inputs: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """An all-gather's result before this process joined: every slot holds its own input."""
    for outs, inp in zip(outputs, inputs):
        for out in outs:
            out.copy_(inp)
    return outputs


class ElasticProcessGroup(dist.ProcessGroup):
    """A process group whose backend is swapped for each generation; see the module doc."""

    def __init__(self, controller: Controller, rank: int, size: int,
                 global_ranks: list[int], name: str, bind_key: str = "",
                 timeout_s: float | None = None) -> None:
        super().__init__(rank, size)
        self._controller = controller
        self._rank, self._size = rank, size
        self._global_ranks = list(global_ranks)
        self._name = name
        # Where its members meet for each generation's inner group. Not torch's name:
        # that counts every group this process ever made, and a replacement has made
        # fewer than the survivors (see Controller.create).
        self.bind_key = bind_key or name
        self.timeout_s = timeout_s
        self.closed = False
        self._waiter = _WorkWaiter(f"checkpointless-pg-{bind_key or name}")
        self._lock = threading.Lock()
        self._gen: int | None = None
        self._inner: dict[str, _Inner] = {}
        self._pending: set[_Op] = set()
        self._failure: str | None = None

    # -- identity --------------------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    @property
    def group_name(self) -> str:
        return self._name

    def __repr__(self) -> str:
        return (f"ElasticProcessGroup({self._name!r}, rank {self._rank} of {self._size}, "
                f"generation {self._gen})")

    # -- generations -----------------------------------------------------------------
    def _bind(self, gen: int, nonce: int = 0) -> None:
        """Build this generation's inner backends (a collective over the group's ranks).

        ``nonce`` tells apart groups of one key made one after another within a
        generation (a group made and destroyed in a loop): each meets under fresh keys.
        """
        with self._lock:
            if self._gen == gen and self._failure is None:
                return
            old, self._inner = self._inner, {}
            epoch = self._controller.epoch
        self._controller.retire(list(old.values()), [])
        inner: dict[str, _Inner] = {}
        for device, kind in self._controller.inner_backends.items():
            inner[device] = self._controller.make_inner(self, gen, device, kind, nonce)
        with self._lock:
            if self._controller.epoch != epoch:  # a failure was declared meanwhile
                stale = list(inner.values())
            else:
                stale = []
                self._inner, self._gen, self._failure = inner, gen, None
        self._controller.retire(stale, [])

    def _fail(self, reason: str) -> None:
        """Fail every pending work and abort the inner backends; see the module doc."""
        with self._lock:
            self._failure = reason
            pending, self._pending = list(self._pending), set()
            inner, self._inner = list(self._inner.values()), {}
        error = CollectiveAborted(f"checkpointless: collective aborted: {reason}")
        for op in pending:
            op.finish(error=error)
        for i in inner:
            i.abort()
        self._controller.retire(inner, [op.inner for op in pending if op.inner is not None])

    # -- dispatch --------------------------------------------------------------------
    def _device_of(self, tensors: Any) -> str:
        while isinstance(tensors, (list, tuple)) and tensors:
            tensors = tensors[0]
        if isinstance(tensors, torch.Tensor) and tensors.device.type != "cpu":
            return tensors.device.type
        return "cpu"

    def _run(self, tensors: Any, call: Callable[[Any], Any],
             local: Callable[[], Any], post: Callable[[], Any] | None = None) -> Any:
        """Run ``call(inner_backend)``, or ``local()`` before this process joined.

        ``post()``, if given, runs when the inner work succeeded and gives the value.
        """
        with self._lock:
            failure, gen = self._failure, self._gen
            inner = self._inner.get(self._device_of(tensors)) if gen is not None else None
            if failure is None and gen is not None and inner is None:
                failure = f"no {self._device_of(tensors)} backend in generation {gen}"
            if failure is None and inner is not None:
                op = _Op()
                self._pending.add(op)
        if failure is not None:
            raise CollectiveAborted(f"checkpointless: collective aborted: {failure}")
        if gen is None:
            self._controller.local_collectives += 1
            return _completed(local())
        try:
            op.inner = call(inner.backend)
        except RuntimeError as exc:  # the backend's own errors (a peer's socket closed)
            self._drop(op)
            raise _as_failure(exc) from exc
        except BaseException:
            self._drop(op)
            raise
        try:
            fut = op.inner.get_future()
        except RuntimeError:  # "Work::getFuture not implemented" (gloo's reduce-scatter)
            fut = self._waiter.watch(op.inner)
        fut.add_done_callback(functools.partial(self._inner_done, op, post))
        return _Work(op)

    def _inner_done(self, op: _Op, post: Callable[[], Any] | None,
                    fut: torch.futures.Future) -> None:
        # The inner future holds this callback, which holds ``op``: drop ``op``'s
        # reference to the inner work, or the cycle (through C++, invisible to Python's
        # collector) keeps the failed generation's gloo context and threads alive.
        op.inner = None
        try:
            value = fut.value()
        except Exception as exc:  # a peer died: the inner group said so
            op.finish(error=_as_failure(exc))
            self._drop(op)
            return
        try:
            if post is not None:
                value = post()
        except Exception as exc:  # a bug, not a peer: never mistaken for a failover
            op.finish(error=exc)
        else:
            op.finish(value)
        self._drop(op)

    def _drop(self, op: _Op) -> None:
        with self._lock:
            self._pending.discard(op)

    # -- collectives (names and arguments as torch's ProcessGroup calls them) ----------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else AllreduceOptions()
        post = None
        if opts.reduceOp == dist.ReduceOp.AVG and self._device_of(tensors) == "cpu":
            # gloo has no AVG, and code that asks dist.get_backend() whether it runs on
            # gloo (Lightning's metric sync) sees "checkpointless" and asks for it.
            summed = AllreduceOptions()
            summed.reduceOp, summed.timeout = dist.ReduceOp.SUM, opts.timeout
            opts, post = summed, functools.partial(self._divide, tensors)
        if self._ordered(tensors, opts):
            return self._ordered_sum(tensors[0], post)
        return self._run(tensors, lambda b: b.allreduce(tensors, opts), lambda: tensors, post)

    def _divide(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The mean from a sum (integers truncate, as Lightning's gloo path does)."""
        for t in tensors:
            if t.is_floating_point() or t.is_complex():
                t.div_(self._size)
            else:
                t.copy_(t / self._size)
        return tensors

    def _ordered(self, tensors: list[torch.Tensor], opts: Any) -> bool:
        """Whether this all-reduce is summed in rank order (see :meth:`_ordered_sum`)."""
        if not self._controller.ordered_allreduce or self._size <= 2 or len(tensors) != 1:
            return False
        t = tensors[0]
        return (t.is_floating_point() and t.device.type == "cpu"
                and opts.reduceOp == dist.ReduceOp.SUM)

    def _ordered_sum(self, tensor: torch.Tensor,
                     then: Callable[[], Any] | None = None) -> Any:
        """A floating-point sum whose every element adds the ranks in rank order.

        A ring all-reduce adds the ranks in an order that depends on where an element
        sits in the buffer, and DDP's buffers are laid out anew after a recovery, so the
        last bits of a recovered run would differ from a run without failures (with 3
        or more ranks; a + b == b + a). Gathering every rank's tensor and adding them in
        rank order makes the result independent of the layout, for (N-1)x the traffic
        of the tensor instead of ring's 2(N-1)/N: ``recovery.ordered_allreduce=false``
        turns it off.
        """
        flat = tensor.detach().reshape(-1).contiguous()
        gathered = torch.empty(self._size * flat.numel(), dtype=flat.dtype)

        def add_in_rank_order() -> list[torch.Tensor]:
            parts = gathered.view(self._size, -1)
            total = parts[0].clone()
            for part in parts[1:]:
                total.add_(part)
            tensor.copy_(total.view_as(tensor))
            return then() if then is not None else [tensor]
        return self._run([tensor], lambda b: b._allgather_base(
            gathered, flat, AllgatherOptions()), lambda: [tensor], add_in_rank_order)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else AllreduceCoalescedOptions()
        return self._run(tensors, lambda b: b.allreduce_coalesced(tensors, opts),
                         lambda: tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else BroadcastOptions()
        return self._run(tensors, lambda b: b.broadcast(tensors, opts), lambda: tensors)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: Any = None) -> Any:
        opts = opts if opts is not None else AllgatherOptions()
        return self._run(inputs, lambda b: b.allgather(outputs, inputs, opts),
                         functools.partial(_gathered_alone, outputs, inputs))

    def _allgather_base(self, output: torch.Tensor, inp: torch.Tensor,
                        opts: Any = None) -> Any:
        opts = opts if opts is not None else AllgatherOptions()

        def local() -> Any:
            output.view(self._size, -1).copy_(inp.reshape(1, -1))
            return [output]
        return self._run(inp, lambda b: b._allgather_base(output, inp, opts), local)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else AllgatherOptions()

        def local() -> Any:
            for out, inp in zip(outputs, inputs):
                out.view(self._size, -1).copy_(inp.reshape(1, -1))
            return outputs
        # gloo has no coalesced form: one all-gather of the inputs side by side.
        flat = torch.cat([i.reshape(-1) for i in inputs])
        gathered = flat.new_empty(self._size * flat.numel())

        def split() -> list[torch.Tensor]:
            rows, at = gathered.view(self._size, -1), 0
            for out, inp in zip(outputs, inputs):
                n = inp.numel()
                out.view(self._size, -1).copy_(rows[:, at:at + n])
                at += n
            return outputs
        return self._run(inputs, lambda b: b._allgather_base(gathered, flat, opts), local,
                         split)

    def reduce_scatter(self, outputs: list[torch.Tensor],
                       inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        opts = opts if opts is not None else ReduceScatterOptions()

        def local() -> Any:
            for out, ins in zip(outputs, inputs):
                out.copy_(ins[self._rank])
            return outputs
        return self._run(outputs, lambda b: b.reduce_scatter(outputs, inputs, opts), local)

    def _reduce_scatter_base(self, output: torch.Tensor, inp: torch.Tensor,
                             opts: Any = None) -> Any:
        opts = opts if opts is not None else ReduceScatterOptions()

        def local() -> Any:
            output.view(-1).copy_(inp.reshape(self._size, -1)[self._rank])
            return [output]
        return self._run(inp, lambda b: b._reduce_scatter_base(output, inp, opts), local)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else ReduceScatterOptions()

        def local() -> Any:
            for out, inp in zip(outputs, inputs):
                out.view(-1).copy_(inp.reshape(self._size, -1)[self._rank])
            return outputs
        # gloo has no coalesced form: one reduce-scatter whose row r holds every
        # input's chunk r side by side.
        flat = torch.cat([i.reshape(self._size, -1) for i in inputs], dim=1).reshape(-1)
        mine = flat.new_empty(flat.numel() // self._size)

        def split() -> list[torch.Tensor]:
            at = 0
            for out in outputs:
                n = out.numel()
                out.view(-1).copy_(mine[at:at + n])
                at += n
            return outputs
        return self._run(inputs, lambda b: b._reduce_scatter_base(mine, flat, opts), local,
                         split)

    # torch 2.13's names for the tensor forms (``dist.all_gather_into_tensor`` calls
    # ``group.all_gather_single``, and so on); a Python ProcessGroup must define them, or
    # the call falls through to C++ and finds no backend.
    def all_gather_single(self, output: torch.Tensor, inp: torch.Tensor,
                          opts: Any = None) -> Any:
        return self._allgather_base(output, inp, opts)

    def reduce_scatter_single(self, output: torch.Tensor, inp: torch.Tensor,
                              opts: Any = None) -> Any:
        return self._reduce_scatter_base(output, inp, opts)

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor],
                                    inputs: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Any:
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def all_to_all_single(self, output: torch.Tensor, inp: torch.Tensor,
                          output_splits: list[int], input_splits: list[int],
                          opts: Any = None) -> Any:
        return self.alltoall_base(output, inp, output_splits, input_splits, opts)

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]],
                            inputs: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else AllgatherOptions()
        return self._run(inputs, lambda b: b.allgather_coalesced(outputs, inputs, opts),
                         functools.partial(_gathered_alone, outputs, inputs))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        return self._run(tensors, lambda b: b.recv_anysource(tensors, tag),
                         self._no_local("recv"))

    def alltoall_base(self, output: torch.Tensor, inp: torch.Tensor,
                      output_splits: list[int], input_splits: list[int],
                      opts: Any = None) -> Any:
        opts = opts if opts is not None else AllToAllOptions()
        return self._run(inp, lambda b: b.alltoall_base(
            output, inp, output_splits, input_splits, opts), self._no_local("all_to_all"))

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                 opts: Any = None) -> Any:
        opts = opts if opts is not None else AllToAllOptions()
        return self._run(inputs, lambda b: b.alltoall(outputs, inputs, opts),
                         self._no_local("all_to_all"))

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else ReduceOptions()
        return self._run(tensors, lambda b: b.reduce(tensors, opts), lambda: tensors)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
               opts: Any = None) -> Any:
        opts = opts if opts is not None else GatherOptions()
        return self._run(inputs, lambda b: b.gather(outputs, inputs, opts),
                         self._no_local("gather"))

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                opts: Any = None) -> Any:
        opts = opts if opts is not None else ScatterOptions()
        return self._run(outputs, lambda b: b.scatter(outputs, inputs, opts),
                         self._no_local("scatter"))

    def barrier(self, opts: Any = None) -> Any:
        opts = opts if opts is not None else BarrierOptions()
        return self._run(None, lambda b: b.barrier(opts), lambda: [])

    def monitored_barrier(self, timeout: datetime.timedelta | None = None,
                          wait_all_ranks: bool = False) -> None:
        """gloo's ``monitored_barrier`` (Lightning's ``_InfiniteBarrier`` calls it on a
        group it makes with ``backend="gloo"``): a barrier that a declared failure ends."""
        self.barrier().wait()

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        return self._run(tensors, lambda b: b.send(tensors, dst, tag), self._no_local("send"))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        return self._run(tensors, lambda b: b.recv(tensors, src, tag), self._no_local("recv"))

    def _no_local(self, what: str) -> Callable[[], Any]:
        def refuse() -> Any:
            raise RuntimeError(
                f"checkpointless: {what} before this process joined the job: a replacement "
                "runs its script's set-up alone, and only collectives whose result the "
                "recovered state overwrites (broadcast, all-reduce, all-gather, barrier) "
                "can complete locally. Move it after Checkpointless(...) / cl.start().")
        return refuse

    def shutdown(self) -> None:
        """``destroy_process_group``: a graceful close. Peers may still be finishing
        the last collective, so the sockets are not shut down unless work is pending."""
        self.closed = True
        with self._lock:
            self._failure = "the process group was destroyed"
            pending, self._pending = list(self._pending), set()
            inner, self._inner = list(self._inner.values()), {}
        if pending:
            self._fail("the process group was destroyed")
        for i in inner:
            if i.gloo is not None:
                i.gloo.release()
            i.backend = None


def _as_failure(exc: BaseException) -> BaseException:
    """An inner backend's error (a peer's socket closed) as a :class:`FailureDetected`."""
    if isinstance(exc, FailureDetected):
        return exc
    return CollectiveAborted(f"checkpointless: collective failed: {exc}")


class Controller:
    """Binds every :class:`ElasticProcessGroup` of this process to one generation."""

    def __init__(self) -> None:
        self.store: dist.Store | None = None
        self.timeout_s = 60.0
        self.inner_backends: dict[str, str] = {"cpu": "gloo"}
        self.ordered_allreduce = True
        self.gen: int | None = None
        self.failure: str | None = None  # why collectives fail now, until activate()
        self.epoch = 0  # bumped by every fail(): a bind that raced with one is void
        self.local_collectives = 0
        self._groups: list[weakref.ref[ElasticProcessGroup]] = []
        self._lock = threading.Lock()
        self._graveyard: list[tuple[list[_Inner], list[Any]]] = []
        self._made_in_gen: dict[str, int] = {}
        self.on_retire_stuck: Callable[[Any], None] | None = None

    def configure(self, store: dist.Store, timeout_s: float,
                  inner_backends: dict[str, str] | None = None) -> None:
        self.store = store
        self.timeout_s = timeout_s
        if inner_backends:
            self.inner_backends = dict(inner_backends)

    def groups(self) -> list[ElasticProcessGroup]:
        with self._lock:
            alive = [g for g in (ref() for ref in self._groups)
                     if g is not None and not g.closed]
            self._groups = [weakref.ref(g) for g in alive]
        return sorted(alive, key=lambda g: g.bind_key)  # one order on every member

    def create(self, opts: Any, _backend_options: Any = None) -> ElasticProcessGroup:
        """The creator torch calls for ``backend="checkpointless"`` (extended API).

        Members meet under a key made of the group's ranks and how many open groups of
        the same ranks this process already has. torch's own name counts every group
        ever made: a replacement that re-runs the script's set-up, or survivors that
        re-enter a loop which makes and destroys a group each time (Lightning's
        ``prepare_data`` barrier), would disagree on it and wait for each other forever.
        """
        ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
        same = sum(1 for g in self.groups() if g._global_ranks == ranks)
        digest = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:12]
        timeout = getattr(opts, "timeout", None)
        group = ElasticProcessGroup(
            self, opts.group_rank, opts.group_size, ranks, str(opts.group_id),
            bind_key=f"{digest}.{same}",
            timeout_s=timeout.total_seconds() if timeout is not None else None)
        with self._lock:
            self._groups.append(weakref.ref(group))
        if self.failure is not None:
            group._failure = self.failure
        elif self.gen is not None:
            # A group made mid-generation: every member makes it now. Count the ones made
            # under this key since the generation began (the same count on every member).
            with self._lock:
                nonce = self._made_in_gen[group.bind_key] = \
                    self._made_in_gen.get(group.bind_key, 0) + 1
            group._bind(self.gen, nonce)
        return group

    def make_inner(self, group: ElasticProcessGroup, gen: int, device: str,
                   kind: str, nonce: int = 0) -> _Inner:
        assert self.store is not None, "Controller.configure() first"
        store = dist.PrefixStore(f"{gen_prefix(gen)}/pg/{group.bind_key}.{nonce}/{device}",
                                 self.store)
        timeout_s = group.timeout_s or self.timeout_s
        if kind == "gloo":
            gloo = AbortableGloo.create(store, group._rank, group._size, timeout_s)
            return _Inner(kind, gloo.backend, gloo)
        if kind == "nccl":  # pragma: no cover - needs GPUs (untested here)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = datetime.timedelta(seconds=timeout_s)
            backend = dist.ProcessGroupNCCL(store, group._rank, group._size, opts)
            return _Inner(kind, backend, None)
        raise ValueError(f"checkpointless: unsupported inner backend {kind!r} for {device}")

    def activate(self, gen: int) -> None:
        """Bind every group to generation ``gen`` (collective: all ranks call it)."""
        self.gen, self.failure = gen, None
        with self._lock:
            self._made_in_gen = {}
        for group in self.groups():  # sorted by bind key: the same order on every member
            group._bind(gen)
        self._reap()

    def fail(self, reason: str) -> None:
        """A failure was declared: fail pending collectives and abort the inner groups."""
        self.failure = reason
        self.epoch += 1
        for group in self.groups():
            group._fail(reason)

    def retire(self, inner: list[_Inner], works: list[Any]) -> None:
        """Abort ``inner`` and free it once ``works`` ended (at once, normally)."""
        if not inner:
            return
        for i in inner:
            i.abort()
        with self._lock:
            self._graveyard.append((inner, works))
        self._reap()

    def _reap(self) -> None:
        with self._lock:
            graves, self._graveyard = self._graveyard, []
        keep = []
        for inner, works in graves:
            if all(w.is_completed() for w in works):
                for i in inner:
                    if i.gloo is not None:
                        i.gloo.release()
                    i.backend = None
            else:
                keep.append((inner, works))
        with self._lock:
            self._graveyard.extend(keep)

    def holding(self) -> bool:
        """True while a retired inner backend still has an operation running."""
        self._reap()
        with self._lock:
            return bool(self._graveyard)

    def wait_released(self, wait_s: float = 5.0) -> bool:
        """Wait until every retired inner backend is freed; False if one is stuck."""
        deadline = time.monotonic() + wait_s
        while True:
            self._reap()
            with self._lock:
                if not self._graveyard:
                    return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)


_controller = Controller()
_registered = False


def controller() -> Controller:
    return _controller


def register_backend() -> None:
    """Make ``backend="checkpointless"`` known to ``torch.distributed`` (idempotent)."""
    global _registered
    if _registered or BACKEND_NAME.upper() in dist.Backend._plugins:
        _registered = True
        return
    dist.Backend.register_backend(BACKEND_NAME, _controller.create, extended_api=True,
                                  devices=["cpu", "cuda"])
    _registered = True


def is_owned(group: Any) -> bool:
    return isinstance(group, ElasticProcessGroup)


def inner_backends_for(backend: str | None) -> dict[str, str]:
    """``init_process_group``'s backend argument as device -> inner backend."""
    if backend is None or backend in ("", BACKEND_NAME, "undefined"):
        kinds = dict(_INNER_DEFAULT)
        if not torch.cuda.is_available():
            kinds.pop("cuda")
        return kinds
    text = str(backend).lower()
    if ":" in text:
        pairs = dict(part.split(":", 1) for part in text.split(","))
        return {dev.strip(): kind.strip() for dev, kind in pairs.items()}
    if text == "nccl":
        return {"cpu": "gloo", "cuda": "nccl"}
    if text == "gloo":
        return {"cpu": "gloo"}
    raise ValueError(f"checkpointless: backend {backend!r} is not supported "
                     "(gloo, nccl or cpu:gloo,cuda:nccl)")


_original_init: Callable[..., Any] | None = None


def install_init_hook(environ: dict[str, str] | None = None) -> None:
    """Route ``torch.distributed.init_process_group`` to the owned group.

    Installed only in workers started by ``checkpointless run``. The script's backend
    name picks the inner backends; its ``init_method``/``store`` are not used (the job
    store is), and a ``rank``/``world_size`` that disagrees with the launcher is refused.
    """
    global _original_init
    register_backend()
    if _original_init is not None:
        return
    _original_init = dist.init_process_group
    original = _original_init

    @functools.wraps(original)
    def init_process_group(backend: str | None = None, init_method: str | None = None,
                           timeout: datetime.timedelta | None = None,
                           world_size: int = -1, rank: int = -1, store: Any = None,
                           **kwargs: Any) -> None:
        env = dict(os.environ if environ is None else environ)
        want_rank, want_world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
        if (rank not in (-1, want_rank)) or (world_size not in (-1, want_world)):
            raise ValueError(
                f"checkpointless: init_process_group(rank={rank}, world_size={world_size}) "
                f"disagrees with the launcher (rank {want_rank} of {want_world}); "
                "leave rank and world_size out under `checkpointless run`")
        join_default_group(want_rank, want_world, inner_backends_for(backend),
                           timeout.total_seconds() if timeout else None, env, **kwargs)

    dist.init_process_group = init_process_group
    dist.distributed_c10d.init_process_group = init_process_group
    _install_new_group_hook()


def _install_new_group_hook() -> None:
    """``new_group(backend="gloo")`` (Lightning's ``prepare_data`` barrier, libraries
    that want a CPU side group) makes an owned group too, once the default one is.

    A plain gloo group would rendezvous through the default group's store, which is
    this process's alone, and hang; it would also outlive a failure unaborted.
    """
    original = dist.distributed_c10d.new_group
    signature = inspect.signature(original)
    if "backend" not in signature.parameters:  # pragma: no cover - another torch
        return

    @functools.wraps(original)
    def new_group(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind_partial(*args, **kwargs)
        backend = bound.arguments.get("backend")
        if backend is not None and str(backend).lower() != BACKEND_NAME and \
                dist.is_initialized() and is_owned(dist.distributed_c10d._get_default_group()):
            bound.arguments["backend"] = None  # inherit the default: checkpointless
            bound.arguments.pop("pg_options", None)
        return original(*bound.args, **bound.kwargs)

    dist.new_group = new_group
    dist.distributed_c10d.new_group = new_group


def join_default_group(rank: int, world_size: int, inner: dict[str, str],
                       timeout_s: float | None, env: dict[str, str] | None = None,
                       **kwargs: Any) -> None:
    """Create the default (WORLD) group as an :class:`ElasticProcessGroup`.

    Under the launcher it binds to generation 0 at once when this process starts the
    job; a replacement (or a process that finds a later generation) stays unbound until
    the runtime joins it to the current generation.
    """
    from recovery import protocol
    from recovery.env import WorkerEnv
    from recovery.recipe import worker_config

    register_backend()
    wenv = WorkerEnv.from_environ(env)
    settings = worker_config(wenv.config_json)
    ctl = _controller
    ctl.ordered_allreduce = settings.recovery.ordered_allreduce
    if ctl.store is None:
        ctl.configure(wenv.connect_store(), timeout_s or settings.recovery.collective_timeout_s,
                      inner)
    else:
        ctl.inner_backends = dict(inner)
    starting = not wenv.replacement and protocol.current_generation(ctl.store) == 0
    original = _original_init or dist.init_process_group
    kwargs.pop("device_id", None)  # the inner NCCL group binds lazily
    original(BACKEND_NAME, store=dist.HashStore(), rank=rank, world_size=world_size,
             timeout=datetime.timedelta(seconds=ctl.timeout_s), **kwargs)
    if starting and ctl.gen is None:
        ctl.activate(0)

