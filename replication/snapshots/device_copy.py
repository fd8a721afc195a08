"""Device-to-host snapshot copies: one side stream, and one completion event, per device.

A device-to-host copy runs on the current stream *of its source tensor's device*, not
of the current device. A single side stream made on the current device therefore
covers only the tensors that live there: with tensors on ``cuda:1`` and no
``set_device`` (pipeline stages, several models per process), their copies would go
to ``cuda:1``'s default stream, and the event the engine fences on and the seal waits
for would be recorded before they land, so the snapshot would hash bytes still in
flight. Here every source device gets its own side stream, the copies from that device
are enqueued on it, and each device gets its own events; the engine makes the compute
stream of *every* device wait for them (:func:`wait_on_compute_streams`) and the seal
synchronises all of them (:func:`synchronize`).

The path is written against torch's device API (``torch.get_device_module(device)``:
its ``Stream``, ``current_stream``, ``stream`` context and ``Stream.record_event``),
which ``torch.cuda`` and the other accelerator modules share, and which a test can
replace with a simulated device whose copies land only at a synchronisation point.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

Pair = tuple[torch.Tensor, torch.Tensor]  # (host destination, source)


def device_module(device: torch.device) -> Any:
    """The torch module of ``device``'s type (``torch.cuda`` for a CUDA tensor).

    Looked up at call time through :func:`torch.get_device_module`, so the device API
    used is whatever that module offers now.
    """
    return torch.get_device_module(device)


@dataclass(frozen=True)
class DeviceEvent:
    """An event recorded on the side stream of ``device``."""

    device: torch.device
    event: Any


def wait_on_compute_streams(events: Sequence[DeviceEvent]) -> None:
    """Make the current stream of each event's device wait for it: what the device
    computes next runs only after the copies before the event have read their tensors."""
    for done in events:
        device_module(done.device).current_stream(done.device).wait_event(done.event)


def synchronize(events: Sequence[DeviceEvent]) -> None:
    """Block until every copy before each event has landed in host memory."""
    for done in events:
        done.event.synchronize()


class DeviceCopier:
    """Enqueues device-to-host copies on one side stream per source device."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}

    def side_stream(self, device: torch.device) -> Any:
        """The side stream of ``device``, made once and then reused (streams are pooled
        by torch, but keeping one avoids pairing copies with another user's stream)."""
        stream = self._streams.get(device)
        if stream is None:
            stream = device_module(device).Stream(device=device)
            self._streams[device] = stream
        return stream

    def copy(self, groups: Sequence[Sequence[Pair]]) -> list[list[DeviceEvent]]:
        """Enqueue ``dst.copy_(src)`` for every pair; return, for each group, one event
        per source device marking the end of that group's copies (and of every earlier
        group's) on that device's side stream.

        Host sources are copied at once. Each side stream first waits for its device's
        compute stream, so the copies read the tensors as the work queued so far leaves
        them; each source is recorded as used by its side stream, so the caching
        allocator does not reuse its memory before the copy has read it.
        """
        by_device: dict[torch.device, list[list[Pair]]] = {}
        for g, group in enumerate(groups):
            for dst, src in group:
                if src.device.type == "cpu":
                    dst.copy_(src)
                    continue
                per_group = by_device.setdefault(src.device, [[] for _ in groups])
                per_group[g].append((dst, src))
        marks: list[list[DeviceEvent]] = [[] for _ in groups]
        for device, per_group in by_device.items():
            mod = device_module(device)
            side = self.side_stream(device)
            side.wait_stream(mod.current_stream(device))
            with mod.stream(side):
                for g, pairs in enumerate(per_group):
                    for dst, src in pairs:
                        dst.copy_(src, non_blocking=True)
                        src.record_stream(side)
                    marks[g].append(DeviceEvent(device, side.record_event()))
        return marks
