"""The device snapshot tier: a rank's own rollback copy in spare accelerator memory.

With ``replication.device: auto`` (the default) or ``cuda``, each snapshot slot gets a
second buffer on the device that holds the state's tensors. A capture then copies
device to device on the device's current stream, which is several times faster than
the device-to-host copy of the host tier and is ordered before anything the loop runs
next, so no fence is needed; a rollback copies device to device again and moves no
state tensor over PCIe (the few tensors that live on the host, such as the RNG state,
go back to the host where they belong).

The bytes still reach host memory, off the training thread: the seal stages the device
buffer into the slot's host buffer (pinned on GPU hosts) chunk by chunk on a side
stream and hashes each chunk as soon as it has landed (:meth:`DeviceTier.stage`), so
the digests are those of the host tier for the same state (:func:`segment_digest` over
the same bytes), and the side channel (gloo, CPU sockets), the handover and the durable
tier read the staged host bytes exactly as before. Replicas held for peers use the
budget left after the own slots (:meth:`DeviceTier.reserve_replica`,
:mod:`replication.replica_protocol.replica_tier`).

Whether the tier is used is decided once, at the first capture of a step later than
the first step the engine captured (the runtime commits the initial state before any
training step, when the allocator has not reached its peak yet):
``mem_get_info()`` of the device, plus what the tier already holds, minus a headroom
(``replication.device_headroom`` of the device's total memory), must hold every slot's
device buffer. Otherwise the host tier is used, with one log line saying why; with
``replication.device=cuda`` that is an error instead.

The code is written against torch's device API (:func:`torch.get_device_module`,
``Tensor.to``/``copy_(non_blocking=...)``, streams and events where the module has
them), parameterised by the device, so CPU tests run every code path with the CPU as
the "device"; only a GPU run shows the real streams and the real free-memory figure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import psutil
import torch

from replication.snapshots import checksum
from replication.snapshots.device_copy import device_module
from replication.snapshots.digest_copy import segment_trailer
from replication.snapshots.memory import MemoryBudgetError
from replication.training_state.codec import recorded_device
from replication.training_state.layout import SnapshotLayout

log = logging.getLogger("checkpointless.replication")

STAGE_CHUNK = 8 << 20  # bytes staged (and then hashed) per device-to-host copy
HOST_SETTINGS = ("host", "cpu")  # "cpu": the name older recipes use for the host tier


class DeviceTierError(MemoryBudgetError):
    """``replication.device=cuda`` and the device tier cannot be used. A memory budget
    error: no retry or replacement can fix it, so the runtime stops the job with it."""


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)  # pragma: no cover


def check_setting(setting: str) -> None:
    """Raise :class:`DeviceTierError` at start when ``setting`` asks for CUDA and this
    process has none (one line: a run that cannot have what it asked for stops now)."""
    if setting == "cuda" and not torch.cuda.is_available():
        raise DeviceTierError("replication.device=cuda but this process has no CUDA device "
                              "(torch.cuda.is_available() is false); use 'auto' or 'host'")


def _host_mem_get_info(device: torch.device) -> tuple[int, int]:
    """Free and total bytes of a CPU "device" (host RAM), for the CPU-as-device tier."""
    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


class DeviceTier:
    """Where and whether a snapshot engine keeps its slots on a device.

    ``device``: the device to use; ``None`` takes the one device the state's tensors
    live on (none, or several, means the host tier). ``required``: a tier that cannot
    be used raises :class:`DeviceTierError` instead of falling back to the host.
    ``mem_get_info(device) -> (free, total)`` defaults to the device module's own.
    """

    def __init__(self, device: torch.device | None = None, *, required: bool = False,
                 headroom: float = 0.1,
                 mem_get_info: Callable[[torch.device], tuple[int, int]] | None = None) -> None:
        self.device = device
        self.required = required
        self.headroom = headroom
        self._mem_get_info = mem_get_info
        self.active: bool | None = None  # None: not decided yet
        self.reason = ""
        self._budget = 0  # bytes the tier may hold, fixed at the decision
        self._own = 0  # bytes the own snapshot slots need (at the decision, or admitted)
        self._replicas = 0  # bytes of replicas held for peers (replica_protocol.replicas)
        self._side: Any = None

    # -- the decision ------------------------------------------------------------------
    def _pick_device(self, tensors: Iterable[torch.Tensor]) -> torch.device | None:
        if self.device is not None:
            return self.device
        found = {t.device for t in tensors if t.device.type != "cpu"}
        if len(found) == 1:
            return found.pop()
        if found:
            self.reason = (f"the state spans {len(found)} devices "
                           f"({', '.join(sorted(map(str, found)))})")
        else:
            self.reason = "no state tensor is on a GPU"
        return None

    def decide(self, tensors: Iterable[torch.Tensor], need: int, held: int) -> bool:
        """Settle :attr:`active` for snapshots of ``need`` device bytes in all, once
        ``held`` bytes of device buffers already exist (they count as free: the tier
        would reuse them); logs the choice. Raises :class:`DeviceTierError` when the
        tier is required and impossible."""
        device = self._pick_device(tensors)
        if device is not None:
            self.device = device
            query = self._mem_get_info or getattr(device_module(device), "mem_get_info", None)
            if query is None and device.type == "cpu":
                query = _host_mem_get_info
            if query is None:
                self.reason = f"{device.type} offers no mem_get_info()"
            else:
                free, total = (int(x) for x in query(device))
                self._budget = free + held - int(self.headroom * total)
                fits = need + self._replicas <= self._budget
                self.reason = (
                    f"{_fmt(need)} of snapshot slots {'fit' if fits else 'do not fit'} in "
                    f"{_fmt(max(0, self._budget))} spare on {device} (free after the first "
                    f"step's peak, less replication.device_headroom={self.headroom:g} of "
                    f"{_fmt(total)})")
                if fits:
                    self.active, self._own = True, need
                    log.info("snapshot copies: device tier: %s", self.reason)
                    return True
        self.active = False
        if self.required:
            raise DeviceTierError(f"replication.device=cuda cannot be used: {self.reason}; "
                                  "use 'auto' (host memory when it does not fit) or 'host'")
        log.info("snapshot copies: host tier: %s", self.reason)
        return False

    def admit(self, need: int) -> bool:
        """Whether ``need`` device bytes in all still fit the budget fixed at the
        decision (a layout that grew); turns the tier off, with a log line, if not."""
        if need + self._replicas <= self._budget:
            self._own = need
            return True
        self.active = False
        self.reason = f"the state grew to {_fmt(need)} of slots, over {_fmt(self._budget)}"
        if self.required:
            raise DeviceTierError(f"replication.device=cuda cannot be used: {self.reason}")
        log.warning("snapshot copies: host tier from now on: %s", self.reason)
        return False

    def reserve_replica(self, nbytes: int, replacing: int = 0) -> bool:
        """Whether a replica buffer of ``nbytes`` (instead of one of ``replacing``
        bytes, released right after) fits beside the own slots and the replicas
        already held; counts it when it does. The own slots come first: they were
        counted at the decision."""
        if not self.active or self._own + self._replicas - replacing + nbytes > self._budget:
            return False
        self._replicas += nbytes
        return True

    def release_replica(self, nbytes: int) -> None:
        """A replica buffer of ``nbytes`` counted by :meth:`reserve_replica` was freed."""
        self._replicas = max(0, self._replicas - nbytes)

    # -- copies ------------------------------------------------------------------------
    def allocate(self, nbytes: int) -> torch.Tensor:
        """A zeroed device byte buffer (zeroed: alignment padding must hash the same)."""
        assert self.device is not None
        return torch.zeros(nbytes, dtype=torch.uint8, device=self.device)

    def copy_in(self, views: list[torch.Tensor], sources: list[torch.Tensor]) -> Any:
        """Copy the live tensors into a slot's device views on the device's current
        stream (ordered before whatever the loop runs next there); returns an event
        marking their end, for the staging (``None`` where the device has no events:
        the CPU copies synchronously)."""
        assert self.device is not None
        for dst, src in zip(views, sources):
            # A host source (an RNG state) is pageable memory, which the next step may
            # change at once: copied synchronously. Device sources stay on the stream.
            dst.copy_(src, non_blocking=src.device.type != "cpu")
        return device_module(self.device).current_stream(self.device).record_event()

    def stage(self, src: torch.Tensor, dst: torch.Tensor, layout: SnapshotLayout,
              skeletons: Mapping[str, bytes], after: Any) -> dict[str, str]:
        """Copy each segment of the device buffer ``src`` into the host buffer ``dst``
        chunk by chunk on a side stream, hashing every chunk as soon as it has landed
        while the later ones are in flight; return the segment digests, equal to
        :func:`~replication.snapshots.digest_copy.compute_digests` of the staged buffer.
        ``after``: the capture's event (the staging reads what those copies wrote)."""
        assert self.device is not None
        mod = device_module(self.device)
        if self._side is None:
            self._side = mod.Stream(device=self.device) if self.device.type != "cpu" \
                else mod.Stream()
        side = self._side
        if after is not None:
            side.wait_event(after)
        digests: dict[str, str] = {}
        for seg in layout.segments:
            hasher = checksum.Hasher()
            landed: list[tuple[Any, int, int]] = []
            with mod.stream(side):
                for a in range(seg.offset, seg.offset + seg.nbytes, STAGE_CHUNK):
                    b = min(a + STAGE_CHUNK, seg.offset + seg.nbytes)
                    dst[a:b].copy_(src[a:b], non_blocking=True)
                    landed.append((side.record_event(), a, b))
            for event, a, b in landed:
                if event is not None:
                    event.synchronize()
                hasher.update(dst[a:b])
            hasher.update(segment_trailer(seg, skeletons[seg.name]))
            digests[seg.name] = hasher.hexdigest()
        return digests


def host_tensors_home(tree: Any) -> Any:
    """``tree`` (decoded from a device buffer) with every tensor captured from the host
    copied back to the host; tensors captured from a device stay where they are.

    The codec records a device tensor's device on its decoded view
    (:func:`replication.training_state.codec.recorded_device`); a view without one was a host tensor
    (an RNG state, a step counter) and must be one again for its owner to load it.
    """
    if isinstance(tree, torch.Tensor):
        if recorded_device(tree) is None and tree.device.type != "cpu":
            return tree.to("cpu")
        return tree
    if isinstance(tree, dict):
        return {k: host_tensors_home(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [host_tensors_home(v) for v in tree]
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(host_tensors_home(v) for v in tree)
    return tree
