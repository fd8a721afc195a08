"""A simulated CUDA device on the CPU, for the device path of snapshots.

Tensors on it (:class:`SimTensor`) claim a ``cuda:<k>`` device and keep their bytes in a
host tensor. Their device-to-host copies are not done when issued: like a real
``non_blocking`` copy they are enqueued on the current stream of the *source* device and
land only when something synchronises with that stream (an event's ``synchronize``, a
stream's ``wait_event``/``wait_stream``/``synchronize``). Installed over ``torch.cuda``'s
stream API by :func:`install`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch


class SimStream:
    def __init__(self, sim: SimDevices, device: Any = None) -> None:
        self.sim = sim
        self.device = sim.as_device(device)
        self.queue: list[Callable[[], None]] = []
        self.landed = 0  # queue[:landed] has run

    def enqueue(self, work: Callable[[], None]) -> None:
        self.queue.append(work)

    def land(self, upto: int | None = None) -> None:
        end = len(self.queue) if upto is None else upto
        while self.landed < end:
            self.queue[self.landed]()
            self.landed += 1

    def synchronize(self) -> None:
        self.land()

    def wait_stream(self, other: SimStream) -> None:
        other.land()

    def wait_event(self, event: SimEvent) -> None:
        event.synchronize()

    def record_event(self, event: SimEvent | None = None) -> SimEvent:
        event = event if event is not None else SimEvent()
        event.record(self)
        return event


class SimEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.stream: SimStream | None = None
        self.at = 0

    def record(self, stream: SimStream | None = None) -> None:
        assert stream is not None, "the simulated device needs an explicit stream"
        self.stream, self.at = stream, len(stream.queue)

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.land(self.at)


class SimDevices:
    """The state of the simulated devices: the current device and stream of each."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.current = 0
        self.default = {i: SimStream(self, torch.device("cuda", i)) for i in range(count)}
        self.streams = dict(self.default)
        self.created: list[SimStream] = []
        self.foreign_records: list[tuple[torch.device, torch.device]] = []

    def as_device(self, device: Any) -> torch.device:
        if device is None:
            return torch.device("cuda", self.current)
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        return torch.device("cuda", self.current if device.index is None else device.index)

    # the torch.cuda API the snapshot engine uses
    def Stream(self, device: Any = None, **_: Any) -> SimStream:
        stream = SimStream(self, device)
        self.created.append(stream)
        return stream

    def Event(self, *args: Any, **kwargs: Any) -> SimEvent:
        return SimEvent()

    def current_device(self) -> int:
        return self.current

    def current_stream(self, device: Any = None) -> SimStream:
        return self.streams[self.as_device(device).index]

    @contextlib.contextmanager
    def stream(self, stream: SimStream) -> Iterator[None]:
        """As ``torch.cuda.stream``: the stream becomes current on *its* device."""
        index = stream.device.index
        before = self.streams[index]
        self.streams[index] = stream
        try:
            yield
        finally:
            self.streams[index] = before

    def in_flight(self) -> int:
        """Copies enqueued on any stream that have not landed yet."""
        return sum(len(s.queue) - s.landed for s in [*self.default.values(), *self.created])


class SimTensor(torch.Tensor):
    """A tensor on a simulated ``cuda:<k>``; its bytes live in ``inner`` (host)."""

    inner: torch.Tensor
    sim: SimDevices

    @staticmethod
    def __new__(cls, inner: torch.Tensor, device: torch.device, sim: SimDevices) -> SimTensor:
        out = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, inner.shape, dtype=inner.dtype, device=device, strides=inner.stride(),
            requires_grad=False)
        out.inner, out.sim = inner, sim
        return out

    def data_ptr(self) -> int:  # type: ignore[override]
        return self.inner.data_ptr()

    def record_stream(self, stream: Any) -> None:  # type: ignore[override]
        if stream.device != self.device:  # the caching allocator would not guard this use
            self.sim.foreign_records.append((self.device, stream.device))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.detach.default:
            return SimTensor(args[0].inner, args[0].device, args[0].sim)
        if func is torch.ops.aten.copy_.default and isinstance(args[1], SimTensor):
            dst, src = args[0], args[1]
            assert not isinstance(dst, SimTensor) and dst.device.type == "cpu"
            data = src.inner  # read when the copy runs, as the device does
            src.sim.current_stream(src.device).enqueue(lambda: dst.copy_(data))
            return dst
        raise NotImplementedError(f"the simulated device does not run {func}")


def install(monkeypatch: pytest.MonkeyPatch, count: int) -> SimDevices:
    """Put ``count`` simulated devices behind ``torch.cuda``'s stream API."""
    sim = SimDevices(count)
    for name in ("Stream", "Event", "current_device", "current_stream", "stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(sim, name))
    return sim
