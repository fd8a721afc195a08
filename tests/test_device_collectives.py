"""Collectives on device tensors through the runtime's process group, checked on CPU.

The owned group (:mod:`recovery.process_group.owned_group`) hands out works of its own over the
inner backend's. Two things go wrong on a GPU that a CPU run with real gloo never shows:

- **stream ordering**: NCCL's future completes once its kernel is enqueued, gloo's (CUDA
  tensors) once its copy back to the device is; only the inner work's ``wait()`` orders
  the caller's stream after the collective. Here a stub inner backend stands in for
  such a backend: its future completes at once, and its ``wait()`` is what writes the
  result. Through the real group, ``work.wait()`` (and ``dist.all_reduce``, blocking or
  not) must see the result, and a declared failure must still end a wait at once;
- **gloo on CUDA tensors** (``cpu:gloo,cuda:gloo``, or several ranks on one GPU): gloo
  has no AVG and the ordered-sum lane runs over gloo, whatever the device. Here the
  group's "cuda" inner backend is a stub that behaves as gloo does (AVG refused), fed
  CPU tensors that report a CUDA device (:class:`_OnCuda`), so the group routes them
  as CUDA tensors while the stub computes on their CPU data.

What only a GPU shows (CUDA events, the device-aware futures, NCCL's and gloo's own
streams) is left to the GPU check.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllreduceOptions

from recovery.common.errors import CollectiveAborted
from recovery.process_group.controller import Controller, _Inner
from recovery.process_group.owned_group import ElasticProcessGroup

pytestmark = pytest.mark.timeout(60)


class _OnCuda(torch.Tensor):
    """A CPU tensor that reports a CUDA device: the group picks the inner backend by the
    device type its tensors report, and the stubs below compute on the CPU data."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


def _on_cuda(values: list[float]) -> torch.Tensor:
    return torch.tensor(values).as_subclass(_OnCuda)


class _StubWork:
    """An inner work: ``future`` as the backend completes it, ``on_wait`` run by the
    first ``wait()`` (what a device backend's stream synchronisation stands for)."""

    def __init__(self, future: torch.futures.Future, on_wait: Any = None) -> None:
        self.future = future
        self.on_wait = on_wait
        self.waits = 0

    def get_future(self) -> torch.futures.Future:
        return self.future

    def is_completed(self) -> bool:
        return self.future.done()

    def wait(self, timeout: Any = None) -> bool:
        self.waits += 1
        if self.on_wait is not None:
            on_wait, self.on_wait = self.on_wait, None
            on_wait()
        return True


def _done(value: Any) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


class _StubBackend:
    """Stands in for an inner backend of the other ranks, whose all-reduce contribution
    is ``others`` (their sum). ``late``: the result is written by the work's ``wait()``,
    after its future completed (NCCL, gloo on CUDA tensors); otherwise before the future
    completes (gloo on CPU). ``gloo``: AVG is refused, as gloo refuses it. ``hang``: the
    future never completes (a dead peer)."""

    def __init__(self, others: torch.Tensor | None = None, *, late: bool = False,
                 gloo: bool = False, hang: bool = False) -> None:
        self.others, self.late, self.gloo, self.hang = others, late, gloo, hang
        self.ops: list[Any] = []
        self.works: list[_StubWork] = []
        self.calls: list[str] = []

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> _StubWork:
        self.calls.append("allreduce")
        self.ops.append(opts.reduceOp)
        if self.gloo and opts.reduceOp == dist.ReduceOp.AVG:
            raise RuntimeError("Cannot use ReduceOp.AVG with Gloo")

        def write() -> None:
            for t in tensors:
                t.add_(self.others)
                if opts.reduceOp == dist.ReduceOp.AVG:
                    t.div_(2)
        if self.hang:
            work = _StubWork(torch.futures.Future(), write)
        elif self.late:
            work = _StubWork(_done(tensors), write)
        else:
            write()
            work = _StubWork(_done(tensors))
        self.works.append(work)
        return work

    # The ordered lane's two phases (recovery.process_group.ordered_sum): recorded, completed at
    # once.
    def alltoall_base(self, out: torch.Tensor, inp: torch.Tensor, *args: Any) -> _StubWork:
        self.calls.append("alltoall_base")
        out.copy_(inp)
        return _StubWork(_done([out]))

    def _allgather_base(self, out: torch.Tensor, inp: torch.Tensor, opts: Any) -> _StubWork:
        self.calls.append("_allgather_base")
        out.view(-1, inp.numel()).copy_(inp.reshape(1, -1))
        return _StubWork(_done([out]))

    def abort(self) -> None:
        pass


class _StubController(Controller):
    """The runtime's controller with the inner backends it builds for each device
    replaced by stubs: ``stubs`` maps a device key ("cpu", "cuda", "cuda/ordered") to
    the backend to plug in there."""

    def __init__(self, inner_backends: dict[str, str], stubs: dict[str, _StubBackend],
                 ordered: bool = False) -> None:
        super().__init__()
        self.inner_backends = dict(inner_backends)
        self.ordered_allreduce = ordered
        self.stubs = stubs
        self.made: list[tuple[str, str]] = []

    def make_inner(self, group: ElasticProcessGroup, gen: int, device: str, kind: str,
                   nonce: int = 0, epoch: int | None = None) -> _Inner:
        self.made.append((device, kind))
        return _Inner(kind, self.stubs.get(device) or _StubBackend(), None)


def _group(ctl: Controller, size: int) -> ElasticProcessGroup:
    """A group of ``size`` ranks of which this process is rank 0, bound to generation 0
    the way the runtime binds it (``Controller.activate``)."""
    group = ctl.create(SimpleNamespace(global_ranks_in_group=list(range(size)),
                                       group_size=size, group_rank=0, group_id="0",
                                       timeout=None))
    ctl.activate(0)
    return group


def _avg() -> AllreduceOptions:
    opts = AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.AVG
    return opts


# -- stream ordering: wait() waits on the inner work -----------------------------------

def test_wait_sees_a_result_the_inner_works_wait_writes():
    """A device backend's future completes before its result is ordered for the caller;
    the caller's wait must also run the inner work's own wait()."""
    others = torch.tensor([10.0, 20.0, 30.0])
    stub = _StubBackend(others, late=True)
    group = _group(_StubController({"cpu": "gloo", "cuda": "nccl"}, {"cuda": stub}), 2)

    t = _on_cuda([1.0, 2.0, 3.0])
    want = torch.tensor([1.0, 2.0, 3.0]) + others
    work = group.allreduce([t])
    assert work.is_completed()  # the inner future said so: not that the result is there
    work.wait()
    assert torch.equal(t, want), t

    t = _on_cuda([1.0, 2.0, 3.0])  # as user code and DDP's constructor call it
    dist.all_reduce(t, group=group, async_op=True).wait()
    assert torch.equal(t, want), t
    t = _on_cuda([1.0, 2.0, 3.0])
    dist.all_reduce(t, group=group)
    assert torch.equal(t, want), t
    assert [w.waits for w in stub.works] == [1, 1, 1]


def test_gloo_cpu_works_are_not_waited_twice():
    """gloo's CPU future completes once the result is written: its work is not waited
    on again (a thread hand-off per collective, on the hot path)."""
    from recovery.process_group.owned_group import waits_on_inner

    stub = _StubBackend(torch.ones(2))
    group = _group(_StubController({"cpu": "gloo"}, {"cpu": stub}), 2)
    t = torch.zeros(2)
    dist.all_reduce(t, group=group)
    assert torch.equal(t, torch.ones(2))
    assert stub.works[0].waits == 0
    assert not waits_on_inner("cpu", "gloo")
    assert waits_on_inner("cuda", "gloo") and waits_on_inner("cuda", "nccl")


def test_a_declared_failure_ends_the_wait_without_waiting_on_the_inner_work():
    """The inner work of a dead peer never completes: the caller's wait ends when the
    failure is declared, and the inner work's wait() is never called (it could block)."""
    stub = _StubBackend(torch.ones(2), hang=True)
    ctl = _StubController({"cpu": "gloo", "cuda": "nccl"}, {"cuda": stub})
    group = _group(ctl, 2)
    work = group.allreduce([_on_cuda([1.0, 2.0])])
    outcome: dict[str, Any] = {}

    def waiter() -> None:
        t0 = time.monotonic()
        try:
            work.wait()
        except Exception as exc:
            outcome["error"] = exc
        outcome["waited_s"] = time.monotonic() - t0
    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive()
    ctl.fail("a peer died")
    thread.join(5.0)
    assert not thread.is_alive()
    assert isinstance(outcome.get("error"), CollectiveAborted), outcome
    assert outcome["waited_s"] < 3.0, outcome
    assert stub.works[0].waits == 0


# -- gloo on CUDA tensors: keyed on the inner backend's kind, not the device -----------

@pytest.mark.parametrize("device,kind", [("cuda", "gloo"), ("cuda", "nccl"), ("cpu", "gloo"),
                                         ("cpu", "nccl")])
def test_avg_is_sent_as_a_sum_to_gloo_whatever_the_device(device, kind):
    """gloo has no AVG, on CPU or CUDA tensors: the group sends a SUM and divides; a
    backend with AVG gets AVG. (The stub refuses AVG when it stands for gloo.)"""
    others = torch.tensor([3.0, 5.0, -7.0])
    stub = _StubBackend(others, gloo=kind == "gloo")
    kinds = {"cpu": "gloo", device: kind}
    group = _group(_StubController(kinds, {device: stub}), 2)
    values = [1.0, 2.0, 4.0]
    t = _on_cuda(values) if device == "cuda" else torch.tensor(values)
    group.allreduce([t], _avg()).wait()
    assert stub.ops == [dist.ReduceOp.SUM if kind == "gloo" else dist.ReduceOp.AVG]
    assert torch.allclose(t, (torch.tensor(values) + others) / 2), t


@pytest.mark.parametrize("device,kind", [("cuda", "gloo"), ("cuda", "nccl"), ("cpu", "gloo"),
                                         ("cpu", "nccl")])
def test_the_ordered_lane_runs_over_gloo_whatever_the_device(device, kind):
    """``recovery.ordered_allreduce``: the lane is built for, and sums run on it, where
    the inner backend is gloo, CPU or CUDA tensors; never over another backend."""
    main, lane = _StubBackend(torch.zeros(4)), _StubBackend()
    kinds = {"cpu": "gloo", device: kind}
    ctl = _StubController(kinds, {device: main, device + "/ordered": lane}, ordered=True)
    group = _group(ctl, 3)
    values = [1.0, 2.0, 3.0, 4.0]
    t = _on_cuda(values) if device == "cuda" else torch.tensor(values)
    group.allreduce([t]).wait()
    laned = kind == "gloo"
    assert ((device + "/ordered", kind) in ctl.made) == laned, ctl.made
    assert ctl.ordered_sums == int(laned)
    assert lane.calls == (["alltoall_base", "_allgather_base"] if laned else [])
    assert main.calls == ([] if laned else ["allreduce"])
