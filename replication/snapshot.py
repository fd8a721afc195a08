"""Local in-memory snapshots: preallocated, reused, double-buffered.

The training loop pays only for copying live tensors into a buffer that already
exists (allocation is several times slower than the copy). Two slots alternate, so the
newest committed snapshot stays intact while the next one is written. Host tensors are
copied with streaming stores (:mod:`replication.streamcopy`) and, by default, hashed
chunk by chunk as they are copied (``checksum="inline"``); ``"background"`` hashes the
finished slot on the replication thread instead.

With ``overlap`` (the replicator's default, ``replication.overlap_copy``) the large
tensors that only ``optimizer.step()`` changes are copied on the replication thread
while the loop runs the next forward and backward pass; an optimizer step pre-hook
fences the copy before the update (:class:`PendingCopy`, ADR 0013). On GPU hosts the
copy is issued on a side CUDA stream into pinned host memory and the same fence makes
the compute stream wait for it. That path is behind ``device``/``pin_memory`` switches
and is untested on this CPU-only machine.

When the durable tier persists snapshots (``shared_memory=True``), the slots live in
shared memory (a memfd), so the durable writer's helper process reads a snapshot straight
from its slot (:func:`shared_location`) and the training process copies nothing; a
slot being read that way is *held* (:meth:`SnapshotEngine.hold`) and never overwritten
until its reader is done.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import torch

from replication import checksum, codec, streamcopy
from replication.layout import (
    FlatState,
    SegmentLayout,
    SnapshotLayout,
    flatten,
    tensor_views,
    unflatten_segment,
)
from replication.replay_check import ReplayCheck
from replication.state import TrainingState, local_tensor

log = logging.getLogger("checkpointless.replication")


class SnapshotError(RuntimeError):
    """A snapshot that is missing, incomplete or fails its checksum."""


class SnapshotTorn(SnapshotError):
    """A tensor changed while an overlapped capture was copying it (see :class:`PendingCopy`)."""


@dataclass(frozen=True)
class SnapshotMeta:
    """Everything about a snapshot except its tensor bytes; small, JSON on the wire."""

    step: int
    layout: SnapshotLayout
    skeletons: dict[str, bytes]
    digests: dict[str, str]  # per segment: segment_digest(its bytes, layout, skeleton)

    def __post_init__(self) -> None:
        # Every segment needs its skeleton to be restored and its digest to be verified.
        names = {seg.name for seg in self.layout.segments}
        if set(self.skeletons) != names or set(self.digests) != names:
            raise SnapshotError(
                f"snapshot metadata of step {self.step}: segments {sorted(names)}, "
                f"skeletons {sorted(self.skeletons)}, digests {sorted(self.digests)}"
            )

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "step": self.step,
                "layout": self.layout.to_json(),
                "skeletons": {k: v.decode("utf-8") for k, v in self.skeletons.items()},
                "digests": self.digests,
            },
            separators=(",", ":"),
        ).encode("utf-8")

    @staticmethod
    def from_bytes(raw: bytes) -> SnapshotMeta:
        """Parse :meth:`to_bytes` output; anything malformed raises :class:`SnapshotError`.

        The bytes may come from a faulty peer, so the checks stop every way they can be
        wrong here rather than as a stray error deep inside a restore.
        """
        try:
            data = json.loads(raw.decode("utf-8"))
            skeletons, digests = data["skeletons"], data["digests"]
            if not all(isinstance(v, str) for v in [*skeletons.values(), *digests.values()]):
                raise TypeError("skeletons and digests must be strings")
            return SnapshotMeta(
                step=int(data["step"]),
                layout=SnapshotLayout.from_json(data["layout"]),
                skeletons={str(k): v.encode("utf-8") for k, v in skeletons.items()},
                digests={str(k): v for k, v in digests.items()},
            )
        # ValueError covers bad UTF-8 and JSON; OverflowError: int(Infinity); RecursionError:
        # absurdly nested JSON; TypeError includes CodecError (a malformed layout).
        except (
            ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError
        ) as exc:
            raise SnapshotError(f"malformed snapshot metadata: {exc!r}"[:300]) from None


@dataclass
class SnapshotSlot:
    """One of the two host buffers, with the step and metadata it currently holds."""

    index: int
    buffer: torch.Tensor | None = None
    layout: SnapshotLayout | None = None
    views: list[torch.Tensor] = field(default_factory=list)
    step: int = -1
    skeletons: dict[str, bytes] = field(default_factory=dict)
    digests: dict[str, str] | None = None
    copy_done: Any = None  # a torch.cuda.Event while an async device copy is in flight
    # wait() of a reader outside the engine that still needs the bytes (SnapshotEngine.hold)
    hold: Callable[[], None] | None = None
    # the part of an overlapped capture still to be copied (SnapshotEngine.seal does it)
    pending: PendingCopy | None = None

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


def allocate_host(nbytes: int, *, pin: bool) -> torch.Tensor:
    """A byte buffer on the host, page-locked when a GPU will copy into it."""
    # Zeroed once, so alignment padding is deterministic and equal states hash equal.
    return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)


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
    are gone. ``pin`` page-locks it for CUDA copies (``cudaHostRegister``; untested).
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
    pinned = False
    if pin:
        try:
            torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
            pinned = True
        except Exception as exc:  # pragma: no cover - GPU hosts only
            log.warning("could not page-lock a %d MB shared snapshot buffer (%r); device "
                        "copies into it will be synchronous", nbytes >> 20, exc)
    with _shared_lock:
        _shared[buf.data_ptr()] = (fd, nbytes, key)
    weakref.finalize(buf, _free_shared, fd, buf.data_ptr(), pinned)
    return buf


def _free_shared(fd: int, addr: int, pinned: bool) -> None:
    with _shared_lock:
        _shared.pop(addr, None)
    if pinned:  # pragma: no cover - GPU hosts only
        try:
            torch.cuda.cudart().cudaHostUnregister(addr)
        except Exception:
            pass
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


HASH_CHUNK = 1 << 20  # bytes of source hashed, then copied from cache, at a time


def segment_trailer(seg: SegmentLayout, skeleton: bytes) -> bytes:
    """What a segment's checksum covers after its buffer bytes: see :func:`segment_digest`."""
    return skeleton + b"\n" + seg.spec_bytes


def segment_digest(seg_bytes: torch.Tensor, seg: SegmentLayout, skeleton: bytes) -> str:
    r"""The checksum recorded for one segment in :attr:`SnapshotMeta.digests`.

    Defined as the hex xxh3-128 of the segment's buffer bytes (all ``seg.nbytes``,
    padding included, in buffer order) immediately followed by
    :func:`segment_trailer`: the skeleton bytes (``SnapshotMeta.skeletons[name]``, its
    UTF-8 JSON), one ``b"\n"``, then ``seg.spec_bytes`` (the compact JSON
    ``[seg.nbytes, [[dtype, shape, offset, nbytes], ...]]``). Tensor bytes alone are
    not enough: the skeleton holds the non-tensor state (step counters, learning
    rates) and the layout says which bytes form which tensor, and damage to either
    would otherwise restore silently. The trailer comes last so that a receiver can
    stream the segment's chunks through a :class:`checksum.Hasher` as they land and
    then ``update`` it with the trailer; compact JSON holds no raw newline, so the
    separator keeps skeleton and layout apart.
    """
    hasher = checksum.Hasher()
    hasher.update(seg_bytes)
    hasher.update(segment_trailer(seg, skeleton))
    return hasher.hexdigest()


def copy_and_digest(
    slot: SnapshotSlot,
    flat: FlatState,
    *,
    streaming: bool = True,
    already_copied: frozenset[int] = frozenset(),
) -> dict[str, str]:
    """Copy host tensors into ``slot`` and checksum each segment in the same pass.

    A large contiguous tensor goes in :data:`HASH_CHUNK` pieces: each piece of the
    *source* is hashed first, which brings it into cache, and is then copied from cache
    into the slot, with streaming stores where :mod:`replication.streamcopy` has them
    (``streaming``). So the source is read from DRAM once and the slot is never pulled
    through the cache. Small or strided tensors are copied by torch and hashed from the
    slot in runs of at least one chunk. The digest covers the segment's bytes in buffer
    order, padding included, then its trailer (skeleton and layout), so it equals
    :func:`segment_digest` of the finished buffer when the copy is right; a copy that
    went wrong fails verification later, since the digest was taken from the source.

    ``already_copied`` holds positions in ``flat.tensors`` whose bytes are in the slot
    already (an overlapped capture copies them on the training thread, see
    :class:`PendingCopy`): they are hashed from the slot, not copied again.
    """
    steps = copy_and_digest_steps(slot, flat, streaming=streaming,
                                  already_copied=already_copied)
    while True:
        try:
            next(steps)
        except StopIteration as finished:
            return finished.value


def copy_and_digest_steps(
    slot: SnapshotSlot,
    flat: FlatState,
    *,
    streaming: bool = True,
    already_copied: frozenset[int] = frozenset(),
) -> Generator[None, None, dict[str, str]]:
    """:func:`copy_and_digest` one piece at a time: a generator that yields after each
    chunk or small tensor and returns the digests. A copy can so be handed from one
    thread to another between two pieces (:class:`PendingCopy`)."""
    assert slot.buffer is not None and slot.layout is not None
    stream = streaming and streamcopy.AVAILABLE
    digests: dict[str, str] = {}
    views, sources = slot.views, flat.tensors
    i = 0
    for seg in slot.layout.segments:
        seg_bytes = slot.buffer[seg.offset : seg.offset + seg.nbytes]
        hasher = checksum.Hasher()
        hashed = 0  # the segment's bytes up to here are in the hasher
        for spec in seg.tensors:
            dst, src = views[i], sources[i]
            i += 1
            if i - 1 in already_copied or spec.nbytes <= HASH_CHUNK or not src.is_contiguous():
                if i - 1 not in already_copied:
                    dst.copy_(src)
                end = spec.offset + spec.nbytes
                if end - hashed >= HASH_CHUNK:
                    hasher.update(seg_bytes[hashed:end])
                    hashed = end
                yield
                continue
            hasher.update(seg_bytes[hashed : spec.offset])  # pending small tensors, padding
            src_b = src.detach().reshape(-1).view(torch.uint8)
            src_view = checksum.tensor_bytes(src_b)
            dst_b = seg_bytes[spec.offset : spec.offset + spec.nbytes]
            src_at, dst_at = src_b.data_ptr(), dst_b.data_ptr()
            for off in range(0, spec.nbytes, HASH_CHUNK):
                n = min(HASH_CHUNK, spec.nbytes - off)
                hasher.update(src_view[off : off + n])
                if stream:
                    streamcopy.copy_bytes(dst_at + off, src_at + off, n)
                else:
                    dst_b[off : off + n].copy_(src_b[off : off + n])
                yield
            hashed = spec.offset + spec.nbytes
        hasher.update(seg_bytes[hashed:])
        hasher.update(segment_trailer(seg, flat.skeletons[seg.name]))
        digests[seg.name] = hasher.hexdigest()
    return digests


DEFER_MIN_BYTES = 64 << 10
"""By default an overlapped capture leaves optimizer-owned tensors at least this large
to :class:`PendingCopy`; smaller ones are copied at once (few bytes, many calls)."""


class PendingCopy:
    """The part of an overlapped capture copied after :meth:`SnapshotEngine.capture` returns.

    It holds the large tensors owned by the state's optimizers (their parameters and
    their state, such as Adam's moments), which nothing but ``optimizer.step()``
    changes, so they can be copied while the loop runs the next forward and backward
    pass. The copy (with the checksum, in one pass) advances one chunk at a time
    (:func:`copy_and_digest_steps`), under a lock, by whichever thread runs it:
    normally the round, on a thread at the lowest priority (``run(background=True)``);
    otherwise the training thread at the engine's fence, before the next optimizer step
    or restore. A fence that finds the copy unfinished takes it over: the background
    thread gives it up at its next chunk boundary, so a starved low-priority thread
    holds the loop up for one chunk at most, never for the rest of the copy.

    Each tensor's version counter (which torch bumps on every in-place change it sees,
    once the change is done) is recorded at capture. A tensor changed before the copy
    finished makes a torn snapshot: :meth:`run` then raises :class:`SnapshotTorn`, so
    the step is never committed. The check is best-effort: a change still running when
    the copy ends is only seen at the next fence, after the step may have committed,
    and changes through ``.data`` are never seen (ADR 0013).
    """

    def __init__(
        self, slot: SnapshotSlot, flat: FlatState, deferred: list[int], *, streaming: bool
    ) -> None:
        self.slot = slot
        self.step = slot.step
        already = frozenset(range(len(flat.tensors))).difference(deferred)
        self._steps: Generator[None, None, dict[str, str]] | None = copy_and_digest_steps(
            slot, flat, streaming=streaming, already_copied=already)
        self._watched = [(i, flat.tensors[i], flat.tensors[i]._version) for i in deferred]
        self._turn = threading.Lock()  # held by the thread advancing the copy
        self._wanted = threading.Event()  # a foreground caller is waiting for the copy
        self.done = threading.Event()
        self.digests: dict[str, str] | None = None
        self.error: BaseException | None = None

    @property
    def nbytes(self) -> int:
        """Bytes copied off the training thread."""
        return sum(t.numel() * t.element_size() for _, t, _ in self._watched)

    def run(self, *, background: bool = False) -> dict[str, str] | None:
        """Do the copy, or what is left of it, and return the digests.

        ``background=True`` gives the copy up, returning ``None``, as soon as a
        foreground caller wants it; a foreground call returns once the copy is done
        (by whichever thread), and raises its error if it failed or is torn.
        """
        if not background:
            self._wanted.set()
        while not self.done.is_set():
            if background and self._wanted.is_set():
                return None
            with self._turn:
                if not self.done.is_set():
                    self._advance(yield_when_wanted=background)
        if self.error is not None:
            raise self.error
        return self.digests

    def _advance(self, *, yield_when_wanted: bool) -> None:
        """Copy chunks until the copy is done (or, with ``yield_when_wanted``, until a
        foreground caller asks for it). Holds ``_turn``."""
        assert self._steps is not None
        try:
            while not (yield_when_wanted and self._wanted.is_set()):
                next(self._steps)
        except StopIteration as finished:
            changed = self.changed()
            if changed:
                self.error = SnapshotTorn(
                    f"snapshot of step {self.step} is torn: {', '.join(changed[:3])} "
                    "changed in place while being copied, outside optimizer.step(). "
                    "Overlapped copies are now off for this run; to keep them off from "
                    "the start, set replication.overlap_copy=false"
                )
            else:
                self.digests = finished.value
            self._finish()
        except BaseException as exc:
            self.error = exc
            self._finish()

    def _finish(self) -> None:
        self._steps = None  # it refers to the live tensors: no reference kept
        self.done.set()

    def changed(self) -> list[str]:
        """The tensors whose version changed since the capture, described for messages."""
        layout = self.slot.layout
        assert layout is not None
        out = []
        for i, t, version in self._watched:
            if t._version != version:
                out.append(_describe_tensor(layout, i))
        return out


def _describe_tensor(layout: SnapshotLayout, index: int) -> str:
    """``state entry 'optim', tensor #3 (float32[2048, 2048])`` for tensor ``index``."""
    for seg in layout.segments:
        if index < len(seg.tensors):
            spec = seg.tensors[index]
            return f"state entry {seg.name!r}, tensor #{index} ({spec.dtype}{list(spec.shape)})"
        index -= len(seg.tensors)
    return f"tensor #{index}"


def _optimizer_owned(state: TrainingState) -> tuple[list[torch.optim.Optimizer], set[int]]:
    """The state's torch optimizers (registered or declared), and the addresses of the
    host tensors they own (parameters and per-parameter state): what only their
    ``step()`` changes."""
    optimizers = state.optimizers()
    owned: set[int] = set()
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                owned.add(local_tensor(p.detach()).data_ptr())
        for per_param in opt.state.values():
            for value in per_param.values():
                if isinstance(value, torch.Tensor):
                    owned.add(local_tensor(value.detach()).data_ptr())
    return optimizers, owned


def _fence_before_step(
    engine_ref: weakref.ReferenceType[SnapshotEngine],
    _optimizer: torch.optim.Optimizer,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """An optimizer step pre-hook: fence the engine's pending copy before any update.

    A step given a closure runs the forward and backward pass inside ``step()``
    (Lightning's automatic optimization does), after this hook: the closure is wrapped
    so that the fence comes after it, right before the update, and the copy still
    overlaps the forward and backward pass.
    """
    engine = engine_ref()
    if engine is None or (engine.pending is None
                          and all(slot.copy_done is None for slot in engine.slots)):
        return None
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if not callable(closure):
        engine.fence()
        return None

    def fenced_closure() -> Any:
        result = closure()
        engine.fence()
        return result

    if "closure" in kwargs:
        return args, {**kwargs, "closure": fenced_closure}
    return (args[0], fenced_closure, *args[2:]), kwargs


def compute_digests(
    buffer: torch.Tensor, layout: SnapshotLayout, skeletons: dict[str, bytes]
) -> dict[str, str]:
    """Per-segment checksums (:func:`segment_digest`) of a host buffer and its skeletons."""
    return {
        s.name: segment_digest(buffer[s.offset : s.offset + s.nbytes], s, skeletons[s.name])
        for s in layout.segments
    }


def verify_segments(
    buffer: torch.Tensor, meta: SnapshotMeta, names: list[str] | None = None
) -> None:
    """Raise :class:`checksum.ChecksumMismatch` naming the first corrupted segment.

    Each segment's bytes, skeleton and layout are checked (:func:`segment_digest`).
    """
    for seg in meta.layout.segments:
        if names is not None and seg.name not in names:
            continue
        got = segment_digest(
            buffer[seg.offset : seg.offset + seg.nbytes], seg, meta.skeletons[seg.name]
        )
        if got != meta.digests.get(seg.name):
            raise checksum.ChecksumMismatch(
                f"snapshot of step {meta.step}: segment {seg.name!r} checksum {got} "
                f"!= recorded {meta.digests.get(seg.name)}"
            )


def restore_from_buffer(state: TrainingState, buffer: torch.Tensor, meta: SnapshotMeta,
                        *, verify: bool = True) -> None:
    """Verify ``buffer`` against ``meta`` (unless the caller just did) and load it into
    the live objects.

    Everything is decoded before anything is loaded, so a malformed snapshot raises
    :class:`SnapshotError` (or ``ChecksumMismatch``) and leaves the live state untouched.
    """
    if buffer.numel() < meta.layout.nbytes:
        raise SnapshotError(f"snapshot of step {meta.step} needs {meta.layout.nbytes} "
                            f"bytes, buffer holds {buffer.numel()}")
    if verify:
        verify_segments(buffer, meta)
    states = {}
    for seg in meta.layout.segments:
        seg_bytes = buffer[seg.offset : seg.offset + seg.nbytes]
        try:
            states[seg.name] = unflatten_segment(seg_bytes, seg, meta.skeletons[seg.name])
        except codec.CodecError as exc:
            raise SnapshotError(
                f"snapshot of step {meta.step}: segment {seg.name!r} cannot be decoded: {exc}"
            ) from None
    state.restore(states)


COPY_NICE = 19
"""The nice value of the thread that does an overlapped copy (the lowest priority)."""


def run_niced(fn: Callable[[], Any]) -> None:
    """Run ``fn`` on a new thread at nice :data:`COPY_NICE` and wait for it; its result
    and any exception are dropped (:meth:`PendingCopy.run` keeps them).

    An overlapped copy competes with the training step for cores. Where a core is idle
    (most GPU hosts) the scheduler runs it there at once; where every core is busy (the
    2-core CI host, two ranks) it takes only the step's idle moments, such as waits in
    collectives, and the rest when the optimizer step's fence blocks the training thread
    on it. Measured in ``bench_snapshot``: ADR 0013. Linux sets nice per thread; a
    fresh thread may always lower its own priority, so no privilege is needed, and the
    thread ends with the copy, so nothing has to raise it again. Elsewhere the call
    fails and the copy runs at normal priority.
    """

    def body() -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COPY_NICE)
        with contextlib.suppress(BaseException):
            fn()

    worker = threading.Thread(target=body, name="checkpointless-copy", daemon=True)
    worker.start()
    worker.join()


def _weak_fence(engine: SnapshotEngine) -> Callable[[], None]:
    """``engine.fence`` without keeping the engine alive (a restore guard on its state)."""
    ref = weakref.ref(engine)

    def guard() -> None:
        live = ref()
        if live is not None:
            live.fence()

    return guard


class SnapshotEngine:
    """Captures a :class:`TrainingState` into two reusable host buffers."""

    def __init__(
        self,
        state: TrainingState,
        *,
        pin_memory: bool | None = None,
        on_allocate: Any = None,
        checksum: str = "inline",
        shared_memory: bool = False,
        num_slots: int = 2,
        streaming: bool = True,
        overlap: bool = False,
        overlap_min_bytes: int = DEFER_MIN_BYTES,
    ) -> None:
        """``on_allocate(layout)`` is called before buffers are (re)allocated, so the
        caller can check the memory budget with the real snapshot size.

        ``shared_memory=True`` allocates the slots in shared memory (falling back to
        ordinary memory, with a warning, where that is impossible), for a durable
        writer that persists straight from them; ``num_slots=3`` then keeps double
        buffering going while one slot is held by such a writer.

        ``checksum="inline"`` hashes host state during the copy (:func:`copy_and_digest`:
        the least total work, since the source is read from DRAM once); ``"background"``
        leaves hashing to :meth:`seal` on the replication thread (the shortest stall,
        but one more pass over the buffer, which competes with training when every core
        is busy). ADR 0001 has the measurements behind the default.

        ``streaming=True`` copies large host tensors with streaming stores where the C
        kernel is built (:mod:`replication.streamcopy`); ``False`` copies with torch.

        ``overlap=True`` makes :meth:`capture` leave the large optimizer-owned host
        tensors to :meth:`seal` (:class:`PendingCopy`), which the replicator runs on
        its round thread while the loop goes on. Optimizer step pre-hooks and a restore
        guard on ``state`` fence the copy (:meth:`fence`) before anything changes those
        tensors. A seal on the capturing thread is always safe, just not overlapped.
        Optimizer-owned tensors under ``overlap_min_bytes`` are copied at capture."""
        if checksum not in ("inline", "background"):
            raise ValueError(f"replication.checksum must be inline or background, got {checksum!r}")
        self.checksum = checksum
        self.streaming = streaming
        if num_slots < 2:
            raise ValueError(f"a snapshot engine needs at least 2 slots, got num_slots={num_slots}")
        self.state = state
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.shared_memory = shared_memory
        self._on_allocate = on_allocate
        self.slots = [SnapshotSlot(i) for i in range(num_slots)]
        self._lock = threading.Lock()
        self._protected_step = -1  # the committed step; its slot is never overwritten
        self._stream = None
        self.overlap = overlap
        self.overlap_min_bytes = overlap_min_bytes
        self.pending: PendingCopy | None = None  # at most one: every capture fences first
        self.fence_wait_s = 0.0  # seconds spent in fence() outside capture: overlap's stall
        self.replay = ReplayCheck()  # a replayed step's digests against its first run's
        self._hooked: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any] = (
            weakref.WeakKeyDictionary()
        )
        if overlap:
            state.add_restore_guard(_weak_fence(self))

    # -- capture ---------------------------------------------------------------------
    def capture(self, step: int) -> SnapshotSlot:
        """Copy the live state into a free slot. This is the training loop's stall.

        With :attr:`overlap`, the large optimizer-owned host tensors are left to
        :meth:`seal` (:class:`PendingCopy`) and everything else is copied now: buffers
        (a forward pass updates batch-norm statistics), RNG, small tensors, anything a
        user object owns. The skeletons (step counters, learning rates) are taken now.
        """
        self._fence()  # no earlier copy may still read the tensors (not counted as a stall)
        flat = flatten(self.state.capture())
        slot = self._free_slot()
        if slot.layout != flat.layout:
            self._allocate(slot, flat.layout)
        with self._lock:  # see seal(): a round abandoned unsealed must not finish this slot
            slot.step, slot.digests = -1, None  # invalid until fully written
            slot.pending = None
        deferred = self._deferrable(flat) if self.overlap else []
        if deferred:
            now = sorted(frozenset(range(len(flat.tensors))).difference(deferred))
            streamcopy.copy_tensors([slot.views[i] for i in now], [flat.tensors[i] for i in now],
                                    enabled=self.streaming)
        else:
            self._copy(slot, flat)
        slot.skeletons = flat.skeletons
        with self._lock:
            slot.step = step
            if deferred:
                slot.pending = self.pending = PendingCopy(slot, flat, deferred,
                                                          streaming=self.streaming)
        return slot

    def _deferrable(self, flat: FlatState) -> list[int]:
        """Positions of the tensors an overlapped capture leaves to :class:`PendingCopy`;
        hooks every registered optimizer that owns one, so its step fences the copy."""
        optimizers, owned = _optimizer_owned(self.state)
        deferred = [
            i for i, t in enumerate(flat.tensors)
            if t.device.type == "cpu" and t.is_contiguous() and not t.is_inference()
            and t.numel() * t.element_size() >= self.overlap_min_bytes
            and t.data_ptr() in owned
        ]
        if deferred:
            self._hook(optimizers)
        return deferred

    def _hook(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Make each optimizer's step fence this engine's copies first (once each)."""
        for opt in optimizers:
            if opt not in self._hooked:
                self._hooked[opt] = opt.register_step_pre_hook(
                    functools.partial(_fence_before_step, weakref.ref(self))
                )

    def fence(self) -> float:
        """Return once no snapshot copy reads the live tensors; the seconds it took.

        Called before anything changes them: by optimizer step pre-hooks, before a
        restore, and by :meth:`capture`. What is left of a pending copy is done here,
        on the calling thread (:class:`PendingCopy`). On GPU hosts, makes the current
        stream wait for in-flight device copies. A tensor found changed since the capture (outside
        ``optimizer.step()``, or the fence would have come first) turns overlapped
        copies off for this engine, with a warning: this loop cannot use them safely.
        The time is added to :attr:`fence_wait_s`.
        """
        waited = self._fence()
        self.fence_wait_s += waited
        return waited

    def _fence(self) -> float:
        pending, t0 = self.pending, time.perf_counter()
        if pending is not None:
            self.pending = None
            try:
                pending.run()
            except Exception:  # seal() raises it, in the round
                pass
            changed = pending.changed()
            if self.overlap and (changed or isinstance(pending.error, SnapshotTorn)):
                self.overlap = False
                log.warning(
                    "overlapped snapshot copies are off for the rest of this run: %s "
                    "changed in place between the capture of step %d and the next "
                    "optimizer.step() (if the change was still running when the copy "
                    "ended, that snapshot is torn); set replication.overlap_copy=false "
                    "for this loop", ", ".join(changed[:3]) or "a tensor", pending.step,
                )
        for slot in self.slots:
            event = slot.copy_done  # read once: seal() clears it on the round thread
            if event is not None:  # GPU only (untested here)
                torch.cuda.current_stream().wait_event(event)
        return time.perf_counter() - t0

    def _free_slot(self) -> SnapshotSlot:
        """The oldest slot that is neither committed nor held by a reader; if every
        uncommitted slot is held, wait for the oldest one's reader (see :meth:`hold`)."""
        while True:
            with self._lock:
                # One slot keeps the committed step; a second copy of it (the step a
                # recovery rolled back to, captured again) is as free as any other.
                kept = next((s for s in self.slots
                             if s.step == self._protected_step and not s.empty), None)
                free = [s for s in sorted(self.slots, key=lambda s: s.step) if s is not kept]
                if not free:  # pragma: no cover - at least two slots, one kept
                    raise SnapshotError("no free snapshot slot")
                for slot in free:
                    if slot.hold is None:
                        return slot
                slot, wait = free[0], free[0].hold
            assert wait is not None
            wait()  # returns once the reader is done with the slot
            self.unhold(slot, wait)

    def hold(self, slot: SnapshotSlot, wait: Callable[[], None]) -> None:
        """Keep :meth:`capture` from overwriting ``slot`` until :meth:`unhold`.

        For a reader outside the engine that needs the slot's bytes as they are (a
        durable writer persisting straight from the slot). Captures take another free
        slot while there is one; a capture that finds only held slots calls ``wait()``,
        which must return only once the reader is done with the slot (cancelling it
        if it takes too long), and then writes into it.
        """
        with self._lock:
            slot.hold = wait

    def unhold(self, slot: SnapshotSlot, wait: Callable[[], None] | None = None) -> None:
        """End :meth:`hold` (only the hold placed with ``wait``, when given)."""
        with self._lock:
            if wait is None or slot.hold is wait:
                slot.hold = None

    def _allocate(self, slot: SnapshotSlot, layout: SnapshotLayout) -> None:
        if self._on_allocate is not None:
            self._on_allocate(layout)
        slot.buffer, slot.views = None, []  # drop the old buffer before allocating the new one
        buf = allocate_shared(layout.nbytes, pin=self.pin_memory) if self.shared_memory else None
        if buf is None and self.shared_memory and layout.nbytes > 0:
            log.warning("cannot allocate a %d MB snapshot buffer in shared memory: using "
                        "private memory, so the durable writer cannot read snapshots in place",
                        layout.nbytes >> 20)
        slot.buffer = buf if buf is not None else allocate_host(layout.nbytes, pin=self.pin_memory)
        slot.layout = layout
        slot.views = tensor_views(slot.buffer, layout)

    def _copy(self, slot: SnapshotSlot, flat: FlatState) -> None:
        if all(t.device.type == "cpu" for t in flat.tensors):
            if self.checksum == "inline":
                slot.digests = copy_and_digest(slot, flat, streaming=self.streaming)
            else:
                streamcopy.copy_tensors(slot.views, flat.tensors, enabled=self.streaming)
            return
        # GPU path (untested here): enqueue device->pinned copies on a side stream. What
        # the next forward pass may change (buffers such as batch-norm statistics, all
        # but the optimizers' tensors) goes first, and the compute stream waits for that
        # part before it runs anything else; the optimizers' step pre-hooks make it wait
        # for the rest before the update (fence()).
        optimizers, owned = _optimizer_owned(self.state)
        self._hook(optimizers)
        pairs = list(zip(slot.views, flat.tensors))
        early = [p for p in pairs if p[1].data_ptr() not in owned]
        late = [p for p in pairs if p[1].data_ptr() in owned]
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for group in (early, late):
                for dst, src in group:
                    dst.copy_(src, non_blocking=True)
                    if src.device.type == "cuda":
                        src.record_stream(self._stream)
                if group is early:
                    early_done = torch.cuda.Event()
                    early_done.record(self._stream)
            slot.copy_done = torch.cuda.Event()
            slot.copy_done.record(self._stream)
        torch.cuda.current_stream().wait_event(early_done)

    def seal(self, slot: SnapshotSlot, *, low_priority: bool = False) -> SnapshotMeta:
        """Finish ``slot`` and checksum it (off the training thread, in the replicator).

        Does an overlapped capture's pending copy (:class:`PendingCopy`, raising
        :class:`SnapshotTorn` if it is torn), waits for an async device copy, and
        hashes what the capture did not already hash. ``low_priority`` does the pending
        copy on a thread of its own at the lowest CPU priority (:func:`run_niced`).
        """
        pending = slot.pending
        if pending is not None:
            if low_priority:
                run_niced(lambda: pending.run(background=True))
            digests = pending.run()  # the digests, or the copy's error
            with self._lock:
                # A round abandoned in a recovery may get here after the slot was
                # captured again: the slot is no longer its snapshot.
                if slot.pending is not pending:
                    raise SnapshotError(f"the slot of step {pending.step} was reused "
                                        "before its round sealed it")
                slot.digests, slot.pending = digests, None
        if slot.copy_done is not None:
            slot.copy_done.synchronize()
            slot.copy_done = None
        assert slot.buffer is not None and slot.layout is not None
        if slot.digests is None:
            slot.digests = compute_digests(slot.buffer, slot.layout, slot.skeletons)
        self.replay.record(slot.step, slot.digests, self.state.replay_exempt)
        return slot.meta()

    # -- a snapshot received from elsewhere ---------------------------------------------
    def incoming_slot(self, layout: SnapshotLayout) -> SnapshotSlot:
        """A free slot, sized for ``layout`` and marked invalid, for a snapshot that
        arrives over the network (a replacement's own state, from its replica): it is
        received straight into the slot, so the replacement holds its snapshot without
        capturing its restored state again (one pass over the bytes instead of three).
        Finish with :meth:`adopt`."""
        self._fence()
        slot = self._free_slot()
        if slot.layout != layout or slot.buffer is None:
            self._allocate(slot, layout)
        with self._lock:
            slot.step, slot.digests, slot.pending, slot.skeletons = -1, None, None, {}
        return slot

    def adopt(self, slot: SnapshotSlot, meta: SnapshotMeta) -> None:
        """Seal ``slot`` (from :meth:`incoming_slot`, its bytes written) as ``meta``'s
        snapshot, after checking every segment against ``meta``'s checksums."""
        assert slot.buffer is not None and slot.layout == meta.layout
        verify_segments(slot.buffer, meta)
        with self._lock:
            slot.skeletons, slot.digests = dict(meta.skeletons), dict(meta.digests)
            slot.step = meta.step

    # -- commit bookkeeping ------------------------------------------------------------
    def protect(self, step: int) -> None:
        """Record that ``step`` is committed: its slot must survive the next capture."""
        with self._lock:
            self._protected_step = step

    @property
    def protected_step(self) -> int:
        return self._protected_step

    def slot_for(self, step: int) -> SnapshotSlot:
        for slot in self.slots:
            if slot.step == step and slot.digests is not None:
                return slot
        held = sorted(s.step for s in self.slots if not s.empty)
        raise SnapshotError(f"no sealed local snapshot of step {step} (holding steps {held})")

    def held_steps(self) -> list[int]:
        return sorted(s.step for s in self.slots if not s.empty and s.digests is not None)

    # -- restore -------------------------------------------------------------------
    def restore(self, step: int, *, verify: bool = True) -> None:
        """Roll the live objects back to the local snapshot of ``step``, verified
        (``verify=False`` only right after :meth:`adopt` checked the same bytes)."""
        slot = self.slot_for(step)
        assert slot.buffer is not None
        restore_from_buffer(self.state, slot.buffer, slot.meta(), verify=verify)

    @property
    def state_bytes(self) -> int:
        return max((s.layout.nbytes for s in self.slots if s.layout is not None), default=0)

    @property
    def allocated_bytes(self) -> int:
        """Host bytes held by the slots' buffers."""
        return sum(s.buffer.numel() for s in self.slots if s.buffer is not None)
