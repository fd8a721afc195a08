"""The runtime's side of a live rollback (ADR 0039): what a survivor reports, and
what every rank does once the plan chose one.

The marks themselves are :mod:`replication.replica_protocol.marks`, the rule the planner applies is
:mod:`recovery.generation.live_plan`, and the handover is
:mod:`replication.replica_protocol.live_handover`; this
module holds the parts that need the runtime's other pieces (its durable tier, its
state registry), like :mod:`recovery.resize.world_resize` does for a resize.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from replication.replica_protocol.handover import HandoverResult
from replication.replica_protocol.live_handover import hand_over_live
from replication.replica_protocol.logged_handover import hand_over_logged
from replication.replica_protocol.mark_exchange import MarkExchange, first_capacity
from replication.replica_protocol.replicator import Replicator
from replication.snapshots.slots import SnapshotSlot, newest_copy
from replication.snapshots.snapshot import SnapshotEngine
from replication.training_state.snapshot_meta import SnapshotError

if TYPE_CHECKING:
    from recovery.generation.rendezvous import RecoveryPlan
    from recovery.runtime.checkpointless import Checkpointless


def _replicator(rt: Checkpointless) -> Replicator | None:
    """The runtime's replicator, if it is one: a process that ran its script again in a
    new world holds a ``world_resize.Carried`` there (its old snapshots, no marks) until
    the new world's replicator is built."""
    rep = rt.replicator
    return rep if isinstance(rep, Replicator) else None


@dataclass(frozen=True)
class SnapshotMarks:
    """``Checkpointless.live_rollback`` for a job whose registered state is the parts of
    a checkpoint rebuilt at each snapshot (the Lightning strategy's, ADR 0039's second
    addendum): ``large`` names the data-parallel parts (the same on every rank),
    ``buffers`` is an entry holding the modules' persistent buffers by value. Marks are
    taken at snapshot steps only, and a live rollback goes on from the survivors' newest
    snapshot even when its round did not commit (the survivors restore it)."""

    large: tuple[str, ...]
    buffers: Any


def start_marks(rt: Checkpointless) -> None:
    """Mark every step (or, with :class:`SnapshotMarks`, every snapshot) from now on,
    and hold the marks of the ranks whose replicas this one keeps, if the job's state
    allows (:func:`replication.replica_protocol.marks.large_entries`). Called with every
    declaration of
    data-parallel entries, in each generation."""
    rep = _replicator(rt)
    if rep is None or not rt.live_rollback:
        return
    parts = rt.live_rollback
    if isinstance(parts, SnapshotMarks):
        rep.marks.declare_parts(parts.large, parts.buffers)
    else:
        rep.marks.declare(rt._dp_entries, sharded=True)
        rep.marks.logs.max_bytes = rep.log_budget()
        if rt.auto_interval is not None and rep.marks.sharded:
            rt.auto_interval.log_steps = rep.marks.logs.steps_that_fit
    if rep.mark_exchange is None and rep.factor > 1:
        sizes = rep.state_bytes_of_rank  # agreed by the generation: both sides' bound
        rep.mark_exchange = MarkExchange(rep.channel, rep.rank, rep.holders[rep.rank],
                                         rep.sources[rep.rank], rep.marks,
                                         lambda r: first_capacity(sizes[r]))


def mark(rt: Checkpointless, step: int) -> None:
    """The end of ``step``: capture this rank's mark and send it to its holders."""
    rep = _replicator(rt)
    if rep is None:
        return
    rep.marks.logs.committed(rep.known_committed)  # a holder's logs start after it
    if rep.mark_exchange is None:
        rep.marks.discard_updates()
        return
    if rep.marks.at_snapshots and not _holds(rep, step):
        return  # marks of checkpoint parts: at snapshot steps only
    # Captured straight into its message: a sharded job's marks are its gradient shards.
    captured = rep.marks.capture(step, into=rep.mark_exchange.reserve)
    if captured is not None and captured.replayable:
        rep.mark_exchange.send(captured)  # one a holder could not replay: a gap


MARKS_SETTLE_S = 2.0  # how long an injected fault waits for this rank's marks to leave


def marks_left(rt: Checkpointless) -> None:
    """Wait (at most :data:`MARKS_SETTLE_S`) for the marks this rank posted to reach
    its holders: an injected fault names a point in a step, and a mark still on the
    wire at that point is a matter of timing (the fault injector's ``settle``)."""
    rep = _replicator(rt)
    if rep is not None and rep.mark_exchange is not None:
        rep.mark_exchange.flush(MARKS_SETTLE_S)


def _holds(rep: Replicator, step: int) -> bool:
    """Whether this rank has a snapshot of ``step`` (sealed or still being copied)."""
    return any(s.step == step for s in rep.engine.slots)


def join_fields(rt: Checkpointless, newcomer: bool) -> dict:
    """What a join record says of live rollback: this rank's live step and the steps of
    the marks it holds (a newcomer: nothing)."""
    rep = _replicator(rt)
    if newcomer or rep is None:
        return {"live_step": -1, "marks": {}}
    held = rep.marks.held_steps()
    logs = rep.marks.logs.first_steps()
    return {"live_step": live_step(rt), "marks": {str(k): v for k, v in held.items()},
            "sharded": rep.marks.sharded, "logs": {str(k): v for k, v in logs.items()}}


def log_bytes(rt: Checkpointless) -> int:
    """Host memory this rank's update logs hold (ADR 0049; the recovery event's)."""
    rep = _replicator(rt)
    return rep.marks.logs.nbytes() if rep is not None else 0


def live_step(rt: Checkpointless) -> int:
    """The step this survivor can go on from without a snapshot (its join record's
    ``live_step``), or -1. Besides the marks' own rule (the large entries untouched
    since the step's mark, :meth:`replication.replica_protocol.marks.MarkBook.live_step`): no
    durable
    save due at a step whose snapshot would then never be taken or committed (the
    committed step's, if not yet handed to the writer, or that of a newer snapshot
    whose round the failure abandoned, other than the live step's own)."""
    rep = _replicator(rt)
    if rep is None or not rt.live_rollback or rep.twins:
        return -1
    step = rep.marks.live_step()
    if step < 0 or rt.durable.save_pending(rep.known_committed):
        return -1
    if rep.marks.at_snapshots and not _holds(rep, step):
        return -1
    newest = max((s.step for s in rep.engine.slots), default=-1)
    if newest > rep.known_committed and newest != step and rt.durable.save_pending(newest):
        return -1
    return step


class _CaptureAhead:
    """A survivor's capture of its live step on a thread of its own, started once its
    join record is written, while the rendezvous waits for the newcomers (ADR 0041): a
    warm spare needs 0.03-0.06 s to reach the rendezvous here, about what the survivor's
    capture of 200 MB costs, which it then no longer adds after the plan. Only the
    rendezvous runs meanwhile, which touches no registered state; the thread is joined
    before anything else does (the next generation's set-up measures the state)."""

    def __init__(self, rt: Checkpointless, rep: Replicator, step: int) -> None:
        self.step = step
        self.seconds = 0.0  # how long the capture took, off the critical path
        self._durable = rt.durable
        self._excluded = False  # _schedule took the step out of the durable saves
        self._slot: SnapshotSlot | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(rt, rep), daemon=True,
                                        name="checkpointless-capture-ahead")
        self._thread.start()

    def _run(self, rt: Checkpointless, rep: Replicator) -> None:
        t0 = time.perf_counter()
        try:
            own = rep.marks.own
            assert own is not None and own.step == self.step
            rep.marks.restore_small(own)  # a plan for another step restores all of it
            self._excluded = _schedule(rt, self.step)  # by the interval in force at L
            slot = rep.capture(self.step)
            rep.engine.seal(slot)
            self._slot = slot
        except BaseException as exc:  # raised again by result(), where the caller is
            self._error = exc
        self.seconds = time.perf_counter() - t0

    def join(self) -> None:
        self._thread.join()

    def result(self) -> SnapshotSlot:
        """The sealed slot of :attr:`step`; the capture's error, raised here."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._slot is not None
        return self._slot

    def holds(self) -> bool:
        """Whether the capture ended well and its slot still holds :attr:`step`."""
        self._thread.join()
        return self._slot is not None and self._slot.step == self.step

    def discard(self, rep: Replicator) -> None:
        """Not used: wait for the capture, then free what it wrote, so no snapshot of a
        step the job rolls back past stays behind. Only this capture wrote a slot of
        :attr:`step` (it started with none newer than the committed step held). The
        step goes back to the durable saves: the job will run it again, and the schedule
        then says whether its snapshot is a save (the interval in force may differ by
        then), on every rank alike."""
        self._thread.join()
        for slot in rep.engine.slots:
            if slot.step == self.step:
                rep.engine.discard(slot)
        if self._excluded:
            self._durable.include(self.step)
            self._excluded = False


_AHEAD: weakref.WeakKeyDictionary[SnapshotEngine, _CaptureAhead] = (
    weakref.WeakKeyDictionary())
"""The capture a survivor started for the plan it waits for, until :func:`transfer`
takes it or the plan turns out not to use it; by engine, which carries over to the
next generation's replicator (built between the rendezvous and the transfer)."""


def rendezvous_capturing_ahead(rt: Checkpointless, live: int, agree: Callable[[], Any]) -> Any:
    """``agree()`` (the rendezvous), with this survivor's capture of its live step
    ``live`` (its join record's) started first on a thread when a live rollback to it
    is possible: that is the only step a live plan can target on this rank, since the
    planner needs every survivor to report the same one. The capture takes a slot
    only when no snapshot newer than the committed one is held (then the slot it takes
    is never one a plan could need: the committed step's is kept, and the others are
    older); it is kept for :func:`transfer` when the plan is that live rollback, and
    discarded otherwise (a snapshot recovery restores every entry, the small ones the
    capture loaded from the mark too). One kept from an earlier attempt at this
    recovery that never reached its transfer is used again when it holds ``live``."""
    rep = _replicator(rt)
    if rep is None:
        return agree()
    ahead = _AHEAD.pop(rep.engine, None)
    if ahead is not None and not (ahead.step == live and ahead.holds()):
        ahead.discard(rep)
        ahead = None
    protected = rep.engine.protected_step
    if (ahead is None and live > protected and not rep.marks.at_snapshots
            and rep.marks.own is not None and rep.marks.own.step == live
            and all(s.empty or s.step <= protected for s in rep.engine.slots)):
        ahead = _CaptureAhead(rt, rep, live)
    kept = False
    try:
        result = agree()
        plan = result[0]
        kept = ahead is not None and plan.live and plan.target_step == live
        return result
    finally:
        if ahead is not None:
            ahead.join()  # nothing else may touch the state while it captures
            if kept:
                _AHEAD[rep.engine] = ahead
            else:
                ahead.discard(rep)


def transfer(rt: Checkpointless, plan: RecoveryPlan) -> HandoverResult:
    """The live handover, then the failed step's gradients dropped and the live step
    committed (see :func:`_schedule` for why inside the recovery); its parts' times
    include ``capture_s`` (a survivor's) and ``commit_s``.

    A survivor loads its own mark and captures its snapshot of the live step first (with
    :class:`SnapshotMarks`, it restores the snapshot it took at that step instead): a
    provider gives a newcomer its large entries from that slot (no second copy), and
    the commit replicates the same slot."""
    rep = rt.replicator
    assert isinstance(rep, Replicator)
    step = plan.target_step
    captured = None
    t0 = time.perf_counter()
    parts = rep.marks.at_snapshots
    ahead = _AHEAD.pop(rep.engine, None)  # a survivor's capture of ``step``, done already
    if ahead is not None and (ahead.step != step or rep.rank in plan.providers):
        ahead.discard(rep)
        ahead = None
    rep.engine.protect(plan.base_step)  # before a capture picks a free slot
    rep.replicas.protect(plan.base_step)
    if ahead is not None:
        captured = ahead.result()
    elif rep.rank not in plan.providers and parts:
        # The state is checkpoint parts, not live objects: restore L's snapshot,
        # finished first if the failure stopped its round before its copy was.
        captured = _sealed(rep, step)
        rep.restore_local(step)
    elif rep.rank not in plan.providers:
        own = rep.marks.own
        assert own is not None and own.step == step
        rep.marks.restore_small(own)
        _schedule(rt, step)
        captured = rep.capture(step)
        rep.engine.seal(captured)
    capture_s = time.perf_counter() - t0
    if plan.logged:  # a sharded job: newcomers replay their optimizer steps (ADR 0049)
        result = hand_over_logged(
            channel=rep.channel, engine=rep.engine, replicas=rep.replicas, book=rep.marks,
            serve=rep.replica_source, rank=rep.rank, live_step=step,
            base_step=plan.base_step, providers=plan.providers,
            chunk_bytes=rep.config.chunk_bytes)
    else:
        result = hand_over_live(
            channel=rep.channel, engine=rep.engine, replicas=rep.replicas, book=rep.marks,
            rank=rep.rank, live_step=step, base_step=plan.base_step,
            providers=plan.providers, chunk_bytes=rep.config.chunk_bytes,
            captured=captured, same_host=rep.config.same_host_handover)
    if rep.rank in plan.providers and not parts:  # a newcomer, its mark loaded just now
        _schedule(rt, step)
    drop_gradients(rt)
    t0 = time.perf_counter()
    rep.snapshot(step, urgent=True, captured=captured)
    rep.wait()
    ahead_s = {"capture_ahead_s": round(ahead.seconds, 4)} if ahead is not None else {}
    result.parts = {"capture_s": round(capture_s, 4), **ahead_s, **result.parts,
                    "commit_s": round(time.perf_counter() - t0, 4)}
    return result


def _sealed(rep: Replicator, step: int) -> SnapshotSlot:
    """This survivor's slot of ``step``, sealed here if its round had not (the failure
    abandoned the round; its thread may still be sealing the same slot)."""
    slot = newest_copy(rep.engine.slots, step, lambda s: True)
    assert slot is not None
    try:
        rep.engine.seal(slot)
    except SnapshotError:
        if slot.step != step or slot.digests is None:
            raise  # not a race with the abandoned round: the slot is not step's
    return slot


def drop_gradients(rt: Checkpointless) -> None:
    """A live rollback keeps the model, but the failed step's partial gradients must
    go, as a replacement has none."""
    assert rt.replicator is not None
    large = rt.replicator.marks.large or ()
    for name, obj in rt.state:
        if name in large and isinstance(obj, torch.nn.Module):
            obj.zero_grad(set_to_none=True)


def _schedule(rt: Checkpointless, step: int) -> bool:
    """Before the live step is captured: a step the schedule snapshots anyway is an
    ordinary snapshot (and a durable save if one is due); any other is never a durable
    save, so the run writes the checkpoints of one without failures. Called once the
    rank's mark of ``step`` is loaded: the interval that decides is the one in force
    at that step's end, the same on every rank (a survivor's live one may already be
    the next agreement's, and a replacement's is the probe's until its mark arrives;
    with ``every_n_steps: auto`` either made ranks decide differently). A step
    declared by checkpoint parts is a snapshot the schedule took: never called. The step is
    snapshotted and committed inside the recovery (:func:`transfer`), before the
    generation trains: a replacement holds no snapshot of the committed step, so until
    this commits its state would have one copy (its holder's replica), and a second
    failure taking that holder would lose it. Returns whether ``step`` was excluded
    from the saves (a capture that is then discarded puts it back)."""
    assert rt.replicator is not None
    if rt.replicator.snapshot_due(step):
        rt.durable.before_capture(step)
        return False
    rt.durable.exclude(step)
    return True
