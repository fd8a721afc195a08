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
   :mod:`replication.side_channel.abortable_gloo`; NCCL: ``abort()``), so their own operations end
   and they can be destroyed at once: nothing of a failed generation keeps running;
3. new collectives raise at once until :meth:`Controller.activate` binds every group
   to the next generation's inner backends, created over the job store under
   ``cl/g{G}/pg/<group name>``.

A process that has not joined a generation yet (a replacement running its script's
set-up: ``init_process_group``, the DDP constructor's weight broadcast and shape
check) completes collectives *locally*: nobody else is there to answer, and all that
they could compute is overwritten by the state the replacement receives when it joins.
They are counted (``Controller.local_collectives``) and reported.

Under ``checkpointless run`` :func:`recovery.process_group.init_hook.install_init_hook` makes
``torch.distributed.init_process_group`` build this group whatever backend the script
names ("gloo", "nccl", "cpu:gloo,cuda:nccl" or none), so scripts written for
``torchrun`` run unchanged. See ``docs/adr/0015-owned-process-group.md``.

This module is the group itself: dispatch to the inner backend, and the local
completion of a process that has not joined. The works it hands out are in
:mod:`recovery.process_group.works`, the binding of every group to a generation in
:mod:`recovery.process_group.controller`.
"""

from __future__ import annotations

import datetime
import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

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

from recovery.common.errors import CollectiveAborted
from recovery.process_group.inflight_clock import CLOCK
from recovery.process_group.ordered_sum import (
    LANE_SUFFIX,
    SerialLane,
    issue_point,
    rank_ordered_sum,
)
from recovery.process_group.works import (
    _as_failure,
    _completed,
    _Op,
    _Work,
    _WorkWaiter,
)

if TYPE_CHECKING:
    from recovery.process_group.controller import Controller, _Inner

BACKEND_NAME = "checkpointless"


def waits_on_inner(device: str, kind: str) -> bool:
    """Whether a caller's ``wait()`` must also wait on the inner work, once its future
    completed: for every backend but gloo on CPU tensors (whose future completes once
    the result is written), that future says nothing of the caller's CUDA stream (see
    :mod:`recovery.process_group.works`). gloo's CPU works are not waited on twice: that costs
    a thread hand-off per collective on the hot path, for nothing."""
    return device != "cpu" or kind != "gloo"


def _cuda_devices(tensors: Any) -> list[torch.device]:
    """The CUDA devices of ``tensors`` (nested lists), for a device-aware future."""
    found: list[torch.device] = []
    stack = [tensors]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, torch.Tensor) and item.is_cuda and item.device not in found:
            found.append(item.device)
    return found


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
        self._lane = SerialLane(f"checkpointless-ordered-{bind_key or name}")
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
        try:
            for device, kind in self._controller.inner_backends.items():
                inner[device] = self._controller.make_inner(self, gen, device, kind, nonce,
                                                            epoch)
                if self._controller.ordered_allreduce and self._size > 2 and kind == "gloo":
                    inner[device + LANE_SUFFIX] = self._controller.make_inner(
                        self, gen, device + LANE_SUFFIX, kind, nonce, epoch)
        except BaseException:  # a failure declared meanwhile: the ones made go too
            self._controller.retire(list(inner.values()), [])
            raise
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
            CLOCK.end(len(pending))
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

    def _kind(self, device: str) -> str | None:
        """The kind of inner backend ("gloo", "nccl") that runs ``device``'s collectives:
        what they can do (gloo has no AVG, whatever the device) depends on it."""
        inner = self._inner.get(device)
        return inner.kind if inner is not None else \
            self._controller.inner_backends.get(device)

    def _begin(self, key: str, tensors: Any = None) -> tuple[_Op | None, _Inner | None]:
        """A new operation, pending on inner backend ``key`` (a device, or a device's
        ordered lane) of this generation; ``(None, None)`` before this process joined
        one. Raises :class:`CollectiveAborted` while a failure is declared. On CUDA
        ``tensors``, the operation's future is device-aware (see :class:`_Op`)."""
        devices = _cuda_devices(tensors) if key.startswith("cuda") else None
        with self._lock:
            failure, gen = self._failure, self._gen
            inner = self._inner.get(key) if gen is not None else None
            if failure is None and gen is not None and inner is None:
                failure = f"no {key} backend in generation {gen}"
            if failure is None and inner is not None:
                op = _Op(devices)
                self._pending.add(op)
                CLOCK.begin()
                return op, inner
        if failure is not None:
            raise CollectiveAborted(f"checkpointless: collective aborted: {failure}")
        return None, None

    def completes_locally(self) -> bool:
        """Whether a collective issued now completes locally: this process has not
        joined a generation yet, and no failure is declared."""
        with self._lock:
            return self._failure is None and self._gen is None

    def _run(self, tensors: Any, call: Callable[[Any], Any],
             local: Callable[[], Any], post: Callable[[], Any] | None = None) -> Any:
        """Run ``call(inner_backend)``, or ``local()`` before this process joined.

        ``post()``, if given, runs when the inner work succeeded and gives the value.
        The operation is completed from the inner future's callback, whose current
        streams wait on the inner work's (see :class:`_Op`), so a ``post()`` on CUDA
        tensors runs after the collective, and the events of our future after both.
        """
        device = self._device_of(tensors)
        op, inner = self._begin(device, tensors)
        if op is None:
            self._controller.local_collectives += 1
            return _completed(local())
        try:
            op.inner = call(inner.backend)
            if waits_on_inner(device, inner.kind):
                op.hold(op.inner)
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
        # A done-callback runs under the stream guard a ``then`` callback gets (the
        # inner future's devices' streams, made to wait on its events), without the
        # child future ``then`` would make on every collective.
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
            if op in self._pending:
                self._pending.discard(op)
                CLOCK.end()

    # -- collectives (names and arguments as torch's ProcessGroup calls them) ----------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else AllreduceOptions()
        post = None
        device = self._device_of(tensors)
        if opts.reduceOp == dist.ReduceOp.AVG and self._kind(device) == "gloo":
            # gloo has no AVG, on CPU or CUDA tensors, and code that asks
            # dist.get_backend() whether it runs on gloo (Lightning's metric sync) sees
            # "checkpointless" and asks for it.
            summed = AllreduceOptions()
            summed.reduceOp, summed.timeout = dist.ReduceOp.SUM, opts.timeout
            opts, post = summed, functools.partial(self._divide, tensors)
        if self._ordered(tensors, opts, device):
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

    def _ordered(self, tensors: list[torch.Tensor], opts: Any, device: str) -> bool:
        """Whether this all-reduce is summed in rank order (see :meth:`_ordered_sum`):
        on gloo only, CPU or CUDA tensors (the lane has not run over NCCL yet)."""
        if not self._controller.ordered_allreduce or self._size <= 2 or len(tensors) != 1:
            return False
        t = tensors[0]
        lane_built = self._gen is None or (t.device.type + LANE_SUFFIX) in self._inner
        return (t.is_floating_point() and lane_built and opts.reduceOp == dist.ReduceOp.SUM
                and self._kind(device) == "gloo")

    def _ordered_sum(self, tensor: torch.Tensor,
                     then: Callable[[], Any] | None = None) -> Any:
        """A floating-point sum whose every element adds the ranks in rank order, at a
        ring's traffic, on this generation's ordered lane
        (:mod:`recovery.process_group.ordered_sum`)."""
        op, lane = self._begin(self._device_of(tensor) + LANE_SUFFIX, tensor)
        if op is None:  # not joined yet: the sum of one rank's tensor is itself
            self._controller.local_collectives += 1
            return _completed(then() if then is not None else [tensor])
        self._controller.ordered_sums += 1
        ready = issue_point(tensor)  # the lane's stream waits for the caller's

        def issue(call: Callable[[], Any]) -> Any:
            with self._lock:  # _fail() sees the work in flight, or we never issue it
                if op not in self._pending:
                    raise CollectiveAborted("checkpointless: collective aborted: "
                                            f"{self._failure or 'the generation ended'}")
                op.inner = call()
                return op.inner

        def job() -> None:
            try:
                rank_ordered_sum(lane.backend, tensor, self._size, issue, ready)
                value = then() if then is not None else [tensor]
            except CollectiveAborted as exc:
                op.finish(error=exc)
            except RuntimeError as exc:  # the lane's own error: a peer went away
                op.finish(error=_as_failure(exc))
            except Exception as exc:  # a bug, not a peer: never mistaken for a failover
                op.finish(error=exc)
            else:
                op.finish(value)
            op.inner = None
            self._drop(op)
        self._lane.submit(job)
        return _Work(op)

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

    def gather_single(self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Any:
        """torch >= 2.15's ``dist.gather_single`` (and ``gather_into_tensor``): every rank's
        ``inp`` into the rows of the root's ``output`` (a placeholder elsewhere), through
        :meth:`gather` over views of those rows."""
        opts = opts if opts is not None else GatherOptions()
        rows = ([row.view(inp.shape) for row in output.view(self._size, -1).unbind(0)]
                if self._rank == opts.rootRank else None)
        return self.gather([rows] if rows is not None else [], [inp], opts)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                opts: Any = None) -> Any:
        opts = opts if opts is not None else ScatterOptions()

        def local() -> Any:
            # DTensor's ``distribute_tensor`` scatters the root's shards (tensor
            # parallelism's ``parallelize_module``, ``src_data_rank=0``); the recovered
            # state overwrites them. The root keeps its own chunk; elsewhere the output
            # keeps what it held.
            if inputs:
                for out, chunks in zip(outputs, inputs):
                    out.copy_(chunks[self._rank])
            return outputs
        return self._run(outputs, lambda b: b.scatter(outputs, inputs, opts), local)

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
                "recovered state overwrites (broadcast, all-reduce, all-gather, scatter, "
                "reduce-scatter, barrier) "
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
            CLOCK.end(len(pending))
        if pending:
            self._fail("the process group was destroyed")
        for i in inner:
            if i.gloo is not None:
                i.gloo.release()
            i.backend = None


def is_owned(group: Any) -> bool:
    return isinstance(group, ElasticProcessGroup)
