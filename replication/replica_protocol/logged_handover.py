"""The handover of a sharded job's live rollback (ADR 0049): nothing is replayed but
the lost ranks' optimizer steps, each on its own replacement.

The plan (:func:`recovery.generation.live_plan.upgrade`) chose this when every
survivor's own shards are still those of the end of step L, and, for each newcomer,
one survivor holds its replica of the committed step C and the unbroken run of its
marks from C+1 to L, each carrying that step's optimizer inputs
(:mod:`replication.replica_protocol.update_log`):

1. each survivor loads its own mark of L and captures its snapshot of L
   (:func:`recovery.runtime.live_rollback.transfer`, before this), as in a
   data-parallel live rollback;
2. each provider sends every newcomer it serves that replica (read where it lies, as
   the snapshot handover does) and the run of marks;
3. a newcomer receives the replica straight into a snapshot slot, every segment
   checked as it lands, and restores it; checks each mark's checksum and runs its
   optimizers on the logged inputs, oldest first; then loads its mark of L (the RNG,
   the data position, the scheduler, the modules' buffers, the hyperparameters in
   force at L);
4. C's snapshots and replicas stay: the runtime commits L right after this, inside
   the recovery, as a data-parallel live rollback does;
5. a barrier on the side channel.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from replication.replica_protocol.handover import (
    HandoverResult,
    Served,
    _Laps,
    post_state,
    receive_state,
)
from replication.replica_protocol.marks import Mark, MarkBook
from replication.replica_protocol.replicas import ReplicaStore
from replication.replica_protocol.update_log import UPDATES, LoggedUpdates, replay
from replication.side_channel import tags
from replication.side_channel.transport import SideChannel
from replication.snapshots.snapshot import SnapshotEngine, restore_from_buffer
from replication.training_state.layout import SnapshotLayout
from replication.training_state.snapshot_meta import SnapshotMeta
from replication.training_state.state import TrainingState


def hand_over_logged(
    *, channel: SideChannel, engine: SnapshotEngine, replicas: ReplicaStore, book: MarkBook,
    serve: Callable[[int, int], Served], rank: int, live_step: int, base_step: int,
    providers: Mapping[int, int], chunk_bytes: int,
) -> HandoverResult:
    """Run steps 2-5 of the module docstring on this rank; returns what moved. The
    result's ``replayed`` part is the optimizer steps this rank ran again (a newcomer's)."""
    out = HandoverResult()
    laps = _Laps()
    sends: list = []
    for dst in sorted(d for d, p in providers.items() if p == rank):
        served = serve(dst, base_step)
        sends += post_state(channel, dst, served.meta, served.source, chunk_bytes,
                            ring=served.ring)
        out.moved += served.meta.layout.nbytes
        run = book.logs.run(dst, base_step + 1, live_step)
        sends += channel.post_send(torch.tensor([len(run)], dtype=torch.int64), dst,
                                   tags.LIVE_OFFER, 1 << 30)
        for mark in run:
            data = mark.to_tensor()
            header = torch.tensor([mark.step, data.numel()], dtype=torch.int64)
            sends += channel.post_send(header, dst, tags.LIVE_MARK_HEADER, 1 << 30)
            sends += channel.post_send(data, dst, tags.LIVE_MARK_DATA, 1 << 30)
            out.moved += data.numel()
    replayed = 0
    if rank in providers:
        src = providers[rank]
        slot = None

        def into_slot(meta: SnapshotMeta) -> torch.Tensor:
            nonlocal slot
            slot = engine.incoming_slot(meta.layout)
            assert slot.buffer is not None
            return slot.buffer

        meta, _ = receive_state(channel, src, chunk_bytes, into=into_slot)
        if meta.step != base_step:
            raise ValueError(f"rank {src} sent a replica of step {meta.step}, "
                             f"expected {base_step}")
        engine.adopt(slot, meta, verified=True)  # every segment checked as it landed
        out.moved += meta.layout.nbytes
        run = _receive_run(channel, src, base_step, live_step)
        out.moved += sum(m.buffer.numel() for m in run)
        laps.lap("receive_s")
        engine.restore(base_step, verify=False)
        laps.lap("restore_s")
        optimizers = {n: o for n, o in book.state if isinstance(o, torch.optim.Optimizer)}
        replayed = replay(optimizers, (_updates(m) for m in run), book.recorder)
        book.restore_small(run[-1])  # verified first; its hyperparameters are L's
        laps.lap("replay_s")
    if sends:
        channel.wait(sends, "logged state transfer")
        laps.lap("send_s")
    engine.protect(base_step)
    replicas.protect(base_step)
    channel.barrier()
    laps.lap("barrier_s")
    out.parts = {k: round(v, 4) for k, v in laps.parts.items()}
    out.parts["optimizer_steps_replayed"] = replayed
    return out


def _receive_run(channel: SideChannel, src: int, base_step: int, live_step: int) -> list[Mark]:
    """The marks of steps ``base_step + 1`` to ``live_step`` from ``src``, in order."""
    count = torch.zeros(1, dtype=torch.int64)
    channel.wait(channel.post_recv(count, src, tags.LIVE_OFFER, 1 << 30), "log length")
    run = []
    for _ in range(int(count.item())):
        header = torch.empty(2, dtype=torch.int64)
        channel.wait(channel.post_recv(header, src, tags.LIVE_MARK_HEADER, 1 << 30),
                     "mark header")
        step, nbytes = (int(x) for x in header.tolist())
        data = torch.empty(nbytes, dtype=torch.uint8)
        channel.wait(channel.post_recv(data, src, tags.LIVE_MARK_DATA, 1 << 30), "mark")
        mark = Mark.from_tensor(data)
        if mark.step != step:
            raise ValueError(f"rank {src} sent a mark of step {mark.step} as step {step}")
        run.append(mark)
    if [m.step for m in run] != list(range(base_step + 1, live_step + 1)):
        raise ValueError(f"rank {src} sent the update log of steps {[m.step for m in run]}, "
                         f"expected {base_step + 1} to {live_step}")
    return run


def _updates(mark: Mark) -> dict:
    """The optimizer inputs a mark logged, checksum verified, not loaded anywhere."""
    seg = mark.meta.layout.segment(UPDATES)
    meta = SnapshotMeta(mark.step, SnapshotLayout((seg,), mark.meta.layout.nbytes),
                        {UPDATES: mark.meta.skeletons[UPDATES]},
                        {UPDATES: mark.meta.digests[UPDATES]})
    sink = LoggedUpdates()
    only = TrainingState(rng=False)
    only.register(UPDATES, sink)
    restore_from_buffer(only, mark.buffer, meta)
    assert sink.loaded is not None
    return sink.loaded
