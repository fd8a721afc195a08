"""The host buffers snapshots live in: the slots, and where their memory comes from.

A snapshot is copied into a buffer that already exists, since allocation is several
times slower than the copy; :class:`SnapshotSlot` is one such buffer with the step and
metadata it holds. When the durable tier persists snapshots, the buffers live in
shared memory (:func:`allocate_shared`, a memfd), so the durable writer's helper
process reads a snapshot straight from its slot (:func:`shared_location`) and the
training process copies nothing. Which slot a capture takes, and when, is the engine's
business (:mod:`replication.snapshots.snapshot`).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from replication.training_state.layout import SnapshotLayout
from replication.training_state.snapshot_meta import SnapshotError, SnapshotMeta

if TYPE_CHECKING:
    from replication.snapshots.overlap import PendingCopy

log = logging.getLogger("checkpointless.replication")


@dataclass
class SnapshotSlot:
    """One of the snapshot buffers, with the step and metadata it currently holds.

    ``buffer`` is always host memory: what the side channel, the handover and the
    durable tier read. With the device tier, the capture writes ``device_buffer`` and
    the seal stages it into ``buffer`` (:mod:`replication.snapshots.device_tier`).
    """

    index: int
    buffer: torch.Tensor | None = None
    layout: SnapshotLayout | None = None
    views: list[torch.Tensor] = field(default_factory=list)
    step: int = -1
    # Which capture wrote it (the engine counts them): a step captured again after a
    # rollback to an earlier one can sit in two slots, and only the newer copy is the
    # one its round committed (see newest_copy).
    seq: int = 0
    skeletons: dict[str, bytes] = field(default_factory=dict)
    digests: dict[str, str] | None = None
    # while async device copies are in flight: one DeviceEvent per source device
    copy_done: list[Any] | None = None
    # wait() of a reader outside the engine that still needs the bytes (SnapshotEngine.hold)
    hold: Callable[[], None] | None = None
    # the part of an overlapped capture still to be copied (SnapshotEngine.seal does it)
    pending: PendingCopy | None = None
    # The device tier (replication.snapshots.device_tier): the slot's device buffer and its
    # views, whether it holds this step's bytes (the host buffer then gets them at the
    # seal), and the event marking the end of the capture's copies into it.
    device_buffer: torch.Tensor | None = None
    device_views: list[torch.Tensor] = field(default_factory=list)
    on_device: bool = False
    device_done: Any = None

    @property
    def empty(self) -> bool:
        return self.step < 0

    def segment_bytes(self, name: str) -> torch.Tensor:
        assert self.buffer is not None and self.layout is not None
        seg = self.layout.segment(name)
        return self.buffer[seg.offset : seg.offset + seg.nbytes]

    def meta(self) -> SnapshotMeta:
        if self.digests is None or self.layout is None:
            raise SnapshotError(f"snapshot of step {self.step} is not sealed yet")
        return SnapshotMeta(self.step, self.layout, dict(self.skeletons), dict(self.digests))


def newest_copy(slots: Iterable[Any], step: int, ready: Callable[[Any], bool]) -> Any | None:
    """The newest of ``slots`` (by their ``seq``) that holds ``step`` and is ``ready``.

    A rollback to step C followed by a replay captures the steps after C again, while
    an older capture of one of them (from the generation that failed, never committed)
    may still sit in another slot. Its tensors are the same bits (replays are exact),
    but entries exempt from the replay check are not: the intervals ``every_n_steps:
    auto`` had chosen were one of them, so ranks restoring different copies of the same
    step snapshotted different steps afterwards and their replication rounds never met
    again. Every lookup by step therefore takes the newest copy, the one the newest
    round of that step (the one that committed) was made from."""
    found = [s for s in slots if s.step == step and ready(s)]
    return max(found, key=lambda s: s.seq) if found else None


def allocate_host(nbytes: int, *, pin: bool, zeroed: bool = True) -> torch.Tensor:
    """A byte buffer on the host, page-locked when a GPU will copy into it.

    Zeroed (one pass over every page) unless ``zeroed`` is false: a snapshot slot's
    alignment padding must be deterministic so that equal states hash equal, but a
    replica slot is only ever written by what arrives (padding included) and read by
    segment, so it skips the pass, and the pages of segments it never receives (shared
    with the local snapshot) are never touched at all.

    A pinned buffer is not taken from torch's pinned allocator (``pin_memory=True``):
    that allocator rounds every block up to a power of two and keeps freed blocks
    cached, so a 5 GiB slot would hold 8 GiB of page-locked memory that the memory
    budget (:mod:`replication.snapshots.memory`) never counted. It is plain anonymous memory (zero
    pages from the kernel) page-locked in place with ``cudaHostRegister``
    (:func:`_page_lock`), so it holds exactly its own pages and is unlocked when freed;
    where that fails it stays ordinary memory, with one warning.
    """
    if pin and nbytes > 0:
        region = mmap.mmap(-1, _page_round(nbytes))
        buf = torch.frombuffer(region, dtype=torch.uint8, count=nbytes)  # keeps region alive
        if _page_lock(buf.data_ptr(), len(region)):
            weakref.finalize(region, _page_unlock, buf.data_ptr()).atexit = False
        return buf
    if not zeroed:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=False)
    return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=False)


_CUDA_HOST_REGISTER_PORTABLE = 1  # page-locked for every device's context, not just one
_unpinned_warned = False  # see _page_lock


def _page_round(nbytes: int) -> int:
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


def _page_lock(address: int, nbytes: int) -> bool:
    """Page-lock host memory for asynchronous device copies (``cudaHostRegister``).

    Returns whether it worked. CUDA runtime calls report failure in their return code,
    not by raising, so it is checked: a buffer that is not page-locked still works, but
    a "non_blocking" device copy into it is synchronous and staged through a bounce
    buffer, so the overlap the engine counts on is lost. The first failure in a process
    is logged as a warning, the others at debug level (every slot fails alike).
    """
    global _unpinned_warned
    try:
        cudart = torch.cuda.cudart()
        code = int(cudart.cudaHostRegister(address, nbytes, _CUDA_HOST_REGISTER_PORTABLE))
        reason = "" if code == 0 else f"cudaHostRegister returned {_cuda_error(cudart, code)}"
    except Exception as exc:  # no CUDA runtime in this process
        reason = f"no CUDA runtime ({exc!r})"[:200]
    if not reason:
        return True
    level = logging.DEBUG if _unpinned_warned else logging.WARNING
    _unpinned_warned = True
    log.log(level, "cannot page-lock a %d MB snapshot buffer: %s; using ordinary memory, so "
            "device-to-host snapshot copies will be synchronous", nbytes >> 20, reason)
    return False


def _page_unlock(address: int) -> None:
    """Undo :func:`_page_lock` before the memory is unmapped; a failure is logged (a
    finalizer must not raise), since it means the memory stays locked."""
    try:
        cudart = torch.cuda.cudart()
        code = int(cudart.cudaHostUnregister(address))
    except Exception as exc:  # pragma: no cover - the runtime went away at shutdown
        log.warning("cannot unlock a snapshot buffer's pages: %r", exc)
        return
    if code != 0:
        log.warning("cudaHostUnregister of a snapshot buffer returned %s",
                    _cuda_error(cudart, code))


def _cuda_error(cudart: Any, code: int) -> str:
    """``code`` with the runtime's name for it, where the runtime can give one."""
    try:
        return f"error {code} ({cudart.cudaGetErrorString(cudart.cudaError(code))})"
    except Exception:
        return f"error {code}"


@dataclass(frozen=True)
class SharedLocation:
    """Where a buffer from :func:`allocate_shared` lives, for another process to map it."""

    fd: int  # a memfd holding the whole buffer: pass it over a Unix socket (SCM_RIGHTS)
    offset: int  # byte offset of the tensor's first element in that file
    key: str  # identifies the memory while it is alive (its inode), for caches elsewhere


_shared_lock = threading.Lock()
_shared: dict[int, tuple[int, int, str]] = {}  # base address -> (fd, bytes, key)


def allocate_shared(nbytes: int, *, pin: bool = False) -> torch.Tensor | None:
    """A zeroed host byte buffer another process can map, or ``None`` where impossible.

    The durable writer's helper process maps the same pages (:func:`shared_location`)
    and persists a snapshot straight from them, so the training process copies
    nothing. The memory is an anonymous ``memfd``, not a named /dev/shm segment: it is
    handed over as a file descriptor, so it can never be leaked by a process killed
    with its whole process group (a name would outlive it), and a small /dev/shm (64 MB
    in a default container) does not limit it. Its pages are reserved up front
    (``posix_fallocate``), so a host out of memory fails here rather than with SIGBUS
    at the first touch. The memory is freed once the returned tensor (keep it
    referenced: slices alone do not keep the descriptor open) and every mapping of it
    are gone. ``pin`` page-locks it for device copies (:func:`_page_lock`).
    """
    if nbytes <= 0 or not hasattr(os, "memfd_create"):
        return None
    try:
        fd = os.memfd_create("checkpointless-snapshot", os.MFD_CLOEXEC)
    except OSError:
        return None
    try:
        os.ftruncate(fd, nbytes)
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, nbytes)
        buf = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes,
                              dtype=torch.uint8)
        key = f"memfd:{os.fstat(fd).st_dev}:{os.fstat(fd).st_ino}"
    except (OSError, RuntimeError):
        os.close(fd)
        return None
    pinned = pin and _page_lock(buf.data_ptr(), nbytes)
    with _shared_lock:
        _shared[buf.data_ptr()] = (fd, nbytes, key)
    weakref.finalize(buf, _free_shared, fd, buf.data_ptr(), pinned)
    return buf


def _free_shared(fd: int, addr: int, pinned: bool) -> None:
    with _shared_lock:
        _shared.pop(addr, None)
    if pinned:
        _page_unlock(addr)
    try:
        os.close(fd)
    except OSError:
        pass


def shared_location(buffer: torch.Tensor) -> SharedLocation | None:
    """Where a buffer from :func:`allocate_shared` (or a slice of one) lives; ``None``
    for any other buffer."""
    if buffer.device.type != "cpu":
        return None
    base = buffer.untyped_storage().data_ptr()
    with _shared_lock:
        entry = _shared.get(base)
    if entry is None:
        return None
    fd, size, key = entry
    offset = buffer.data_ptr() - base
    if offset < 0 or offset + buffer.numel() * buffer.element_size() > size:
        return None
    return SharedLocation(fd, offset, key)


def shared_keys() -> list[str]:
    """Keys of this process's shared buffers that are still alive."""
    with _shared_lock:
        return [key for _, _, key in _shared.values()]
