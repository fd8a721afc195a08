"""Per-step marks: what a data-parallel job needs to go on from its last completed step
after a failure, without a snapshot of that step and without replaying anything.

In a data-parallel job the model and its optimizer state are the same on every rank,
and a failure detected in step K (in its gradient all-reduce, or at the next step's
start) finds them still as they were at the end of step K-1: the optimizer step that
would change them never ran. What differs per rank and moves inside a step is small:
the RNG, the data position, the scheduler, loop counters, the user's own objects. A
*mark* is that small part, captured through the snapshot codec at every step boundary,
together with the version counters of every tensor of the large entries (and the
optimizers' hyperparameters), which tell later whether those entries are still the
boundary's. Each rank sends its mark to its replica holders every step; a lost rank's
replacement then gets the large entries from any survivor's live tensors and its own
small part from its holder (ADR 0039).

What is "large": the entries declared data-parallel (a DDP module, the model given to
``all_reduce_gradients``) and every optimizer all of whose parameters belong to them.
The data-parallel modules' persistent buffers (batch norm statistics) move in every
forward pass, so a mark holds them by value too. A job with any other module or
optimizer entry (an FSDP2 shard, a TP or pipeline stage, a model not declared
data-parallel) gets *sharded* marks instead (ADR 0049, :func:`sharded_entries`): every
module and optimizer is large, and the mark's small part also carries the step's
optimizer inputs (:mod:`replication.replica_protocol.update_log`; not counted in
:data:`MAX_MARK_BYTES`), which a holder keeps as a run since the committed step
(:mod:`replication.replica_protocol.peer_logs`). A job whose state those inputs do
not determine (a trainable parameter in no optimizer) has no marks: its recoveries
take the snapshot path. So does one whose
small part outgrows :data:`MAX_MARK_BYTES` (an EMA copy of the model registered as a
plain object, say): capturing it at every step would cost what a snapshot does.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from replication.replica_protocol.peer_logs import PeerLogs
from replication.replica_protocol.update_log import (
    UPDATES,
    UpdateRecorder,
    optimized_modules,
    set_hyperparameters,
)
from replication.snapshots.checksum import DIGEST_CHARS
from replication.snapshots.snapshot import encode_to_buffer, restore_from_buffer
from replication.training_state.layout import flatten
from replication.training_state.snapshot_meta import SnapshotMeta
from replication.training_state.state import TrainingState

log = logging.getLogger("checkpointless.replication")

MAX_MARK_BYTES = 4 << 20  # a larger small part makes the job's recoveries take snapshots
MARK_ALIGN = 64  # a mark's bytes start on such a boundary in its tensor


@dataclass(frozen=True)
class Mark:
    """One rank's small part at the end of ``step``: the snapshot metadata and bytes of
    its small entries (checksummed like a snapshot's segments)."""

    step: int
    meta: SnapshotMeta
    buffer: torch.Tensor
    replayable: bool = True  # its optimizer inputs can be replayed (not sent if not)

    @functools.cached_property
    def meta_bytes(self) -> bytes:
        """``meta.to_bytes()``, encoded once: the capture, the send and a handover
        each need it, and a sharded mark's layout names every gradient shard."""
        return self.meta.to_bytes()

    @property
    def has_updates(self) -> bool:
        """Whether it carries its step's optimizer inputs (a sharded job's mark)."""
        return any(seg.name == UPDATES for seg in self.meta.layout.segments)

    @staticmethod
    def body_offset(meta_len: int) -> int:
        """Where the bytes start in :meth:`to_tensor`'s: after the metadata, on a
        64-byte boundary (every dtype's view of them needs its own alignment)."""
        return -(-(8 + meta_len) // MARK_ALIGN) * MARK_ALIGN

    def to_tensor(self) -> torch.Tensor:
        """One byte tensor: the metadata's length (8 bytes), the metadata, padding to
        :meth:`body_offset`, the bytes."""
        raw = self.meta_bytes
        out = torch.zeros(self.body_offset(len(raw)) + self.buffer.numel(), dtype=torch.uint8)
        self.write_into(out, raw)
        return out

    def write_into(self, out: torch.Tensor, raw: bytes) -> None:
        """:meth:`to_tensor`'s bytes written into ``out`` (a message: no copy between),
        ``raw`` being ``meta.to_bytes()``."""
        self.write_head(out, raw)
        at = self.body_offset(len(raw))
        out[at : at + self.buffer.numel()] = self.buffer

    @staticmethod
    def write_head(out: torch.Tensor, raw: bytes) -> None:
        """The part of :meth:`to_tensor` before the bytes: the metadata's length and
        the metadata ``raw``."""
        out[:8] = torch.tensor([len(raw)], dtype=torch.int64).view(torch.uint8)
        out[8 : 8 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    def lies_in(self, out: torch.Tensor, raw: bytes) -> bool:
        """Whether the bytes already are where :meth:`write_into` would put them."""
        return self.buffer.numel() == 0 or \
            self.buffer.data_ptr() == out.data_ptr() + self.body_offset(len(raw))

    @staticmethod
    def from_tensor(data: torch.Tensor, copy: bool = True) -> Mark:
        """``copy=False``: the mark keeps a view of ``data`` (a received message that
        nothing reuses)."""
        meta_len = int(data[:8].view(torch.int64).item())
        meta = SnapshotMeta.from_bytes(data[8 : 8 + meta_len].numpy().tobytes())
        body = data[Mark.body_offset(meta_len) :]
        return Mark(meta.step, meta, body.clone() if copy else body)


def large_entries(state: TrainingState, data_parallel: Iterable[str]) -> list[str] | None:
    """The entries a mark leaves out (the data-parallel modules and their optimizers),
    or ``None`` when the job cannot have marks: some module or optimizer entry is
    neither (see the module docstring), or nothing is data-parallel."""
    dp = set(data_parallel)
    params = {id(p) for name, obj in state if name in dp and isinstance(obj, torch.nn.Module)
              for p in obj.parameters()}
    large = []
    for name, obj in state:
        if name in dp and isinstance(obj, torch.nn.Module):
            large.append(name)
        elif isinstance(obj, torch.nn.Module):
            return None
        elif isinstance(obj, torch.optim.Optimizer):
            mine = [id(p) for g in obj.param_groups for p in g["params"]]
            if not mine or not all(i in params for i in mine):
                return None
            large.append(name)
    return large if any(n in dp for n in large) else None


def sharded_entries(state: TrainingState) -> tuple[list[str] | None, str]:
    """A job whose modules are not all data-parallel (FSDP2 or TP shards, pipeline
    stages, a model nobody declared): every module and optimizer is large, and a lost
    rank's are rebuilt from its replica plus the optimizer inputs logged since
    (:mod:`replication.replica_protocol.update_log`). Returns the entries, or ``None``
    and why not."""
    modules = [(n, o) for n, o in state if isinstance(o, torch.nn.Module)]
    optims = [(n, o) for n, o in state if isinstance(o, torch.optim.Optimizer)]
    if not modules:
        return None, "no module is registered"
    why = optimized_modules([o for _, o in modules], [o for _, o in optims])
    if why is not None:
        return None, why
    return [n for n, _ in (*modules, *optims)], ""


def _large_tensors(objs: Sequence[Any]) -> list[torch.Tensor]:
    """The tensors whose versions say whether the large entries moved: parameters and
    optimizer state. Not buffers: DDP writes them in every forward (it broadcasts rank
    0's), and batch norm moves its statistics there; marks carry them instead."""
    out: list[torch.Tensor] = []
    for obj in objs:
        if isinstance(obj, torch.nn.Module):
            out += list(obj.parameters())
        else:
            out += [t for s in obj.state.values() for t in s.values() if torch.is_tensor(t)]
    return out


BUFFERS = "_dp_buffers"  # the mark's entry holding the data-parallel modules' buffers


class _Buffers:
    """The persistent buffers of the data-parallel modules (batch norm statistics, step
    counters), as one state entry of the marks: they move in a step's forward pass, so a
    mark holds them by value. Keys are ``entry/buffer``; a load finds each module by its
    entry name, so a replacement that has not declared anything loads them as well."""

    def __init__(self, state: TrainingState, names: Iterable[str]) -> None:
        self.state = state
        self.names = list(names)

    def _buffers(self, name: str) -> dict[str, torch.Tensor]:
        module = next(obj for entry, obj in self.state if entry == name)
        persistent = module.state_dict(keep_vars=True)
        return {k: b for k, b in module.named_buffers() if k in persistent}

    def state_dict(self) -> dict[str, Any]:
        return {f"{name}/{k}": b for name in self.names for k, b in self._buffers(name).items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        found: dict[str, dict[str, torch.Tensor]] = {}
        with torch.no_grad():
            for key, value in state_dict.items():
                name, _, buffer = key.partition("/")
                if name not in found:
                    found[name] = self._buffers(name)
                found[name][buffer].copy_(value)


class _Hyperparameters:
    """A mark's :data:`UPDATES` entry loaded on a rank that records none (a
    replacement before its declaration): it sets the hyperparameters in force at the
    mark on the registered optimizers it names."""

    def __init__(self, state: TrainingState) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return {"calls": [], "after": {}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_hyperparameters({n: o for n, o in self.state
                             if isinstance(o, torch.optim.Optimizer)}, state_dict["after"])


def _hyperparameters(objs: Sequence[Any]) -> str:
    """The optimizers' non-tensor settings (a scheduler changes ``lr`` in place)."""
    return repr([[{k: v for k, v in g.items() if k != "params"} for g in o.param_groups]
                 for o in objs if isinstance(o, torch.optim.Optimizer)])


class MarkBook:
    """This rank's newest mark and the version record taken with it, and the newest
    mark it holds of each peer. Carried from one generation to the next, like the
    snapshots and replicas."""

    def __init__(self, state: TrainingState) -> None:
        self.state = state
        self.large: list[str] | None = None  # None: no marks (see large_entries)
        self._small: TrainingState | None = None
        self._large_objs: list[Any] = []
        self.own: Mark | None = None
        self._versions: tuple[tuple[int, int], ...] = ()
        self._hyper = ""
        self.held: dict[int, Mark] = {}
        self._lock = threading.Lock()
        self._too_large_warned = False
        self._buffers_entry: Any = None  # set by declare_parts, for good
        # A job whose modules are not all data-parallel (ADR 0049): the optimizers'
        # inputs travel in every mark, and the holders keep them since the last commit.
        self.recorder: UpdateRecorder | None = None
        self.why_no_marks = ""  # when the job has none: why (the recovery event says it)
        self.logs = PeerLogs()

    @property
    def sharded(self) -> bool:
        """Whether marks carry the optimizers' inputs (:attr:`recorder`)."""
        return self.recorder is not None

    @property
    def at_snapshots(self) -> bool:
        """Whether marks hold a state declared by parts (:meth:`declare_parts`)."""
        return self._buffers_entry is not None

    def declare_parts(self, large: Sequence[str], buffers: Any) -> None:
        """Marks of a state whose large entries are not live objects but parts of a
        checkpoint taken at each snapshot (the Lightning strategy's model and optimizer
        parts): a mark is taken only right after a snapshot's capture, and the step a
        survivor can go on from is that snapshot's, whose slot holds the large entries
        (no version counters: the snapshot is the evidence, and the survivors restore
        it). ``buffers``: a state entry holding the modules' persistent buffers by value
        (they differ per rank after a forward pass), loaded after the large entries."""
        if self.at_snapshots and list(large) == self.large:
            return
        self.large, self.own = list(large), None
        small = TrainingState(rng=False)
        for name, obj in self.state:
            if name not in self.large:
                small.register(name, obj)
        small.register(BUFFERS, buffers)
        self._small, self._large_objs, self._buffers_entry = small, [], buffers

    def declare(self, data_parallel: Iterable[str], sharded: bool = True) -> None:
        """The data-parallel entries are known (or changed): which entries marks hold.
        ``sharded``: a job that is not data-parallel gets marks with its optimizers'
        inputs (:func:`sharded_entries`); False: none."""
        if self.at_snapshots:  # declared by parts, for good
            return
        large = large_entries(self.state, data_parallel)
        logged = False
        if large is None:
            self.why_no_marks = "the model is not data-parallel"
            if sharded:
                large, why = sharded_entries(self.state)
                logged = large is not None
                self.why_no_marks = why
        if large == self.large and logged == self.sharded:
            return
        if self.recorder is not None:
            self.recorder.remove()
        self.large, self.own, self._small, self.recorder = large, None, None, None
        if large is not None:
            small = TrainingState(rng=False)
            for name, obj in self.state:
                if name not in large:
                    small.register(name, obj)
            modules = [n for n, o in self.state if n in large and isinstance(o, torch.nn.Module)]
            small.register(BUFFERS, _Buffers(self.state, modules))
            if logged:
                self.recorder = UpdateRecorder(
                    {n: o for n, o in self.state
                     if n in large and isinstance(o, torch.optim.Optimizer)})
                small.register(UPDATES, self.recorder)
            self._small = small
            self._large_objs = [obj for name, obj in self.state if name in large]

    def capture(self, step: int,
                into: Callable[[int], torch.Tensor | None] | None = None) -> Mark | None:
        """Mark the end of ``step``; ``None`` when the job has no marks. ``into(n)``:
        where the ``n`` bytes of the mark's :meth:`Mark.to_tensor` go (its message,
        :meth:`MarkExchange.reserve`), or ``None``: then a buffer of its own."""
        if self._small is None:
            return None
        replayable = self.recorder.check() if self.recorder is not None else True
        flat = flatten(self._small.capture())
        small = flat.layout.nbytes - sum(seg.nbytes for seg in flat.layout.segments
                                         if seg.name == UPDATES)
        if small > MAX_MARK_BYTES:
            self._give_up(small)
            return None
        out, head = None, b""
        if into is not None:  # the metadata's length is known before its digests are
            head = SnapshotMeta(step, flat.layout, dict(flat.skeletons),
                                {seg.name: "0" * DIGEST_CHARS
                                 for seg in flat.layout.segments}).to_bytes()
            out = into(Mark.body_offset(len(head)) + flat.layout.nbytes)
        body = None if out is None else out[Mark.body_offset(len(head)):]
        meta, buf = encode_to_buffer(flat, step, body)
        mark = Mark(step, meta, buf, replayable)
        if out is not None:
            if len(mark.meta_bytes) == len(head):
                mark.write_head(out, mark.meta_bytes)
            else:  # cannot happen while digests have one length; never sent half-written
                mark = Mark(step, meta, buf.clone(), replayable)
        if self.recorder is not None:
            self.recorder.taken()  # copied into the mark: the next one starts empty
        self.own = mark
        self._versions = self._version_record()
        self._hyper = _hyperparameters(self._large_objs)
        return mark

    def _version_record(self) -> tuple[tuple[int, int], ...]:
        """The large tensors' version counters, and the optimizer steps begun (a
        DTensor's counter does not move under a ``foreach`` optimizer step)."""
        if self.recorder is None:
            return tuple((id(t), t._version) for t in _large_tensors(self._large_objs))
        # A sharded job: the optimizers' parameters, not the modules'. FSDP2 registers
        # unsharded parameters on its modules between an all-gather and the reshard
        # after it, which a failure in forward or backward leaves in place.
        objs = [o for o in self._large_objs if isinstance(o, torch.optim.Optimizer)]
        params = [p for o in objs for g in o.param_groups for p in g["params"]]
        return (*((id(t), t._version) for t in (*params, *_large_tensors(objs))),
                (0, self.recorder.begun))

    def discard_updates(self) -> None:
        """No mark is taken at this step (none is sent): the optimizer inputs recorded
        since the last one go, or they would pile up."""
        if self.recorder is not None:
            self.recorder.taken()

    def _give_up(self, nbytes: int) -> None:
        if not self._too_large_warned:
            self._too_large_warned = True
            log.warning("live rollback off: the state besides the data-parallel model and "
                        "optimizer is %d bytes per step (over %d); recoveries replay from "
                        "the last snapshot", nbytes, MAX_MARK_BYTES)
        if self.recorder is not None:
            self.recorder.remove()
        self.large, self._small, self.own, self.recorder = None, None, None, None
        self.why_no_marks = "the state besides the model and optimizer is too large"

    def live_step(self) -> int:
        """The step whose end the live state still is (its large entries untouched
        since that step's mark), or -1. Declared by parts: the step of the newest mark
        (the caller checks that its snapshot is still held)."""
        if self._small is None or self.own is None:
            return -1
        if self.at_snapshots:
            return self.own.step
        now = self._version_record()
        if now != self._versions or _hyperparameters(self._large_objs) != self._hyper:
            return -1
        return self.own.step

    def restore_small(self, mark: Mark) -> None:
        """Load ``mark``'s small entries into the live objects (verified first). The
        entries are the ones the mark holds, so a replacement that has not declared its
        data-parallel entries yet loads a survivor's marks all the same."""
        restore_from_buffer(self.subset(s.name for s in mark.meta.layout.segments),
                            mark.buffer, mark.meta)

    def subset(self, names: Iterable[str]) -> TrainingState:
        """The registered entries named ``names`` (and the marks' buffers entry), as a
        state of their own."""
        wanted = set(names)
        out = TrainingState(rng=False)
        for name, obj in self.state:
            if name in wanted:
                out.register(name, obj)
        if BUFFERS in wanted:
            out.register(BUFFERS, self._buffers_entry if self.at_snapshots
                         else _Buffers(self.state, ()))
        if UPDATES in wanted:  # its load sets the hyperparameters in force at the mark
            out.register(UPDATES, self.recorder if self.recorder is not None
                         else _Hyperparameters(self.state))
        missing = wanted - set(out.names())
        if missing:
            raise KeyError(f"state entries {sorted(missing)} are not registered here")
        return out

    def store_peer(self, src: int, mark: Mark) -> None:
        with self._lock:
            self.held[src] = mark
        if mark.has_updates:
            self.logs.append(src, mark)

    def held_steps(self) -> dict[int, int]:
        with self._lock:
            return {src: m.step for src, m in self.held.items()}

    def peer(self, src: int, step: int) -> Mark:
        with self._lock:
            mark = self.held.get(src)
        if mark is None or mark.step != step:
            raise KeyError(f"no mark of rank {src} at step {step}")
        return mark
