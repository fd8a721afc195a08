"""Snapshot, replicate, commit: the per-step pipeline, run off the training thread.

``Replicator.snapshot(step)`` is all the training loop calls. It copies the live state
into a free local buffer (the only part the loop waits for; with
``replication.overlap_copy`` only what anything but ``optimizer.step()`` may change)
and hands the rest of the round to a background thread:

1. seal: the overlapped part of the copy, on a thread at the lowest CPU priority,
   while the loop runs the next forward and backward pass (ADR 0013), and per-segment
   checksums of the new snapshot;
2. announce: an all-gather on the side group of (step, metadata size, segment
   fingerprints), so every rank knows what every peer holds;
3. transfer: each rank sends its metadata and the segments its holders do not already
   hold (pure data parallelism sends almost nothing), chunked and pipelined, and
   receives the replicas it is meant to hold, verifying their checksums;
4. commit: agree with every rank that every copy of the step exists (acknowledgements
   up a tree of ranks, "committed" back down, rank 0 writes the one sealed store
   record: :mod:`.commit_tree`, ADR 0022), then mark the step committed locally so its
   buffers survive the next capture.

The next ``snapshot`` waits for the previous round (two buffers per copy at most). A
round's error (a dead peer, a timeout, a bad checksum) is raised at the next call.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch
import torch.distributed as dist

from replication.config import MemoryConfig, ReplicationConfig
from replication.errors import CheckpointlessError
from replication.replica_protocol.commit import COMMITTED_KEY, CommitLedger, committed_step
from replication.replica_protocol.commit_record import CommittedRecorder
from replication.replica_protocol.commit_tree import SideChannelTransport, TreeCommit
from replication.replica_protocol.drift import DriftWatch
from replication.replica_protocol.handover import HandoverResult, Served, hand_over
from replication.replica_protocol.mark_exchange import MarkExchange
from replication.replica_protocol.marks import MarkBook
from replication.replica_protocol.placement import place_replicas, sources_of
from replication.replica_protocol.replica_tier import receive_staged
from replication.replica_protocol.replicas import ReplicaStore
from replication.side_channel import tags
from replication.side_channel.transport import SideChannel, TransportError
from replication.snapshots.checksum import ChecksumMismatch
from replication.snapshots.device_tier import HOST_SETTINGS, DeviceTier, check_setting
from replication.snapshots.digest_copy import verify_as_they_land, verify_segments
from replication.snapshots.memory import (
    MemoryPlan,
    check_budget,
    host_budget_bytes,
    lazy_optimizer_bytes,
)
from replication.snapshots.slots import SnapshotSlot
from replication.snapshots.snapshot import SnapshotEngine
from replication.training_state.layout import SegmentLayout, SnapshotLayout, flatten
from replication.training_state.snapshot_meta import SnapshotMeta
from replication.training_state.state import TrainingState

log = logging.getLogger("checkpointless.replication")

#: Seconds :meth:`Replicator.close` waits for the last committed-step record to land.
RECORD_FLUSH_S = 10.0

MAX_SEGMENTS = tags.MAX_SEGMENTS
_ANN_HEADER = 3  # step, metadata bytes, segment count
_META_TAG = tags.ROUND_META


class _RoundThread:
    """The one daemon thread that runs a replicator's rounds, one after another. Not a
    ThreadPoolExecutor (joined at exit: a round abandoned on a dead peer would hold the
    process), nor a thread per round (``Thread.start`` stalled the loop 0.13-1 ms per
    snapshot on a 2-core host, against 2 us to hand a round over)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[..., RoundStats], *args: object) -> Future:
        fut: Future = Future()
        if self._thread is None:  # started at the first round, not at construction
            self._thread = threading.Thread(target=self._serve, daemon=True,
                                            name="checkpointless-replicate")
            self._thread.start()
        self._queue.put((fut, fn, args))
        return fut

    def stop(self) -> None:
        """Let the thread end after the round it runs (if any); never waits for it."""
        self._queue.put(None)

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:
                fut.set_exception(exc)


class ReplicationError(CheckpointlessError, RuntimeError):
    """A replication round failed; the step it was for is not committed."""


@dataclass(frozen=True)
class RoundStats:
    """What one round did, for logs, events and benchmarks."""

    step: int
    seal_s: float
    transfer_s: float
    commit_s: float
    bytes_sent: int
    bytes_received: int
    segments_skipped: int
    overlapped_bytes: int = 0  # copied by the round for an overlapped capture


class Replicator:
    """Keeps a rank's training state in memory locally and on ``factor-1`` peer nodes."""

    def __init__(
        self,
        state: TrainingState,
        *,
        store: dist.Store,
        rank: int,
        world_size: int,
        node: int,
        local_world_size: int = 1,
        config: ReplicationConfig | None = None,
        memory: MemoryConfig | None = None,
        prefix: str = "checkpointless",
        committed_key: str | None = None,
        hostname: str | None = None,
        previous: Replicator | None = None,
        fault_hook: Callable[[str, int], None] | None = None,
        durable_staging: bool = False,
        durable_zero_copy: bool = False,
        twins: Sequence[int] = (),
        tier_device: torch.device | None = None,
        should_abort: Callable[[], bool] | None = None,
    ) -> None:
        """``previous``: the previous generation's replicator, whose snapshots and replicas
        this one carries over (not its side channel); ``fault_hook(phase, step)`` runs at
        the ``snapshot`` and ``replication`` phases, for tests. ``durable_staging``: a
        durable writer keeps a staging copy of one snapshot, counted in the budget.
        ``durable_zero_copy``: a durable writer persists straight from the snapshot slots:
        a new engine allocates three in shared memory (one held by the writer while two
        alternate), and no staging copy is counted.
        ``twins``: ranks whose state is this rank's own (data-parallel ranks, after the
        world changed size): it serves its snapshots as theirs, across generations, until
        a step commits (then they have replicas).
        ``tier_device``: the device tier's device (``replication.device`` auto or cuda),
        not the state's; a CPU test passes the CPU. ``should_abort()``: a failure was
        declared (it ends a round's wait, and the side channel's wait for a peer)."""
        self.config = config or ReplicationConfig()
        if tier_device is None:
            check_setting(self.config.device)  # cuda without CUDA: one line, at start
        self.memory = memory or MemoryConfig()
        self.state = state
        self.rank, self.world_size, self.local_world_size = rank, world_size, local_world_size
        engine = previous.engine if previous is not None else None
        replicas = previous.replicas if previous is not None else None
        pin = torch.cuda.is_available()  # host buffers, pinned for side-stream copies
        # Measured once, before our buffers exist, so re-checks do not count them twice.
        # Buffers carried over from a previous generation already reduced free RAM.
        held = (engine.allocated_bytes if engine else 0) + (replicas.nbytes() if replicas else 0)
        self._budget = host_budget_bytes(self.memory, local_world_size) + (
            held if self.memory.host_budget_bytes == 0 else 0
        )
        self.engine = engine or SnapshotEngine(
            state, pin_memory=pin, on_allocate=self._check_layout_budget,
            checksum=self.config.checksum,
            shared_memory=durable_zero_copy or self.config.same_host_handover,
            num_slots=3 if durable_zero_copy else 2, streaming=self.config.streaming_copy,
            overlap=self.config.overlap_copy, overlap_min_bytes=self.config.overlap_min_bytes,
            device_tier=self._device_tier(tier_device),
        )
        self.engine._on_allocate = self._check_layout_budget
        self.replicas = replicas or ReplicaStore(pin_memory=pin, tier=self.engine.tier,
                                                 chunk_bytes=self.config.chunk_bytes)
        self.twins = frozenset(twins)
        self._fault_hook = fault_hook
        self._durable_staging = durable_staging and not durable_zero_copy
        self.should_abort = should_abort
        declared = should_abort and (lambda: "a failure was declared" if should_abort() else None)
        self.channel = SideChannel(store, rank, world_size, prefix=f"{prefix}/side",
                                   timeout_s=self.config.timeout_s, hostname=hostname,
                                   interrupted=declared)
        self._store = store
        self._committed_key = committed_key or COMMITTED_KEY
        # The commit agreement (ADR 0022): a tree over the side channel, or a store count.
        self.tree: TreeCommit | None = None
        self.ledger: CommitLedger | None = None
        self._recorder: CommittedRecorder | None = None
        if self.config.commit == "tree":
            # Rank 0's store record is written off the step's path (ADR 0022, addendum 2)
            if rank == 0:
                self._recorder = CommittedRecorder(store, self._committed_key)
            self.tree = TreeCommit(rank, world_size, SideChannelTransport(self.channel),
                                   self._record_committed, decided=self._keep)
        else:
            self.ledger = CommitLedger(
                store, world_size, ack_prefix=f"{prefix}/acks",
                committed_key=self._committed_key, timeout_s=self.config.timeout_s,
            )
        # Every rank's node and expected state size: placement needs the nodes, the
        # budget the sizes of the states this rank will hold replicas of.
        expected = self._expected_state_bytes()
        gathered = self.channel.allgather(torch.tensor([node, expected], dtype=torch.int64))
        self.node_of_rank = [int(t[0]) for t in gathered]
        self.state_bytes_of_rank = [int(t[1]) for t in gathered]
        # The copies kept: at most one per process. Not written back into ``config``
        # (nor into a copy of it): ``config`` is the job's settings object, shared with
        # ``every_n_steps: auto``, which changes the interval in it while training runs.
        self.factor = min(self.config.factor, world_size)
        if self.factor < self.config.factor:
            log.warning("replication.factor=%d but the job has %d process(es): keeping %d "
                        "copies", self.config.factor, world_size, world_size)
        self.holders = place_replicas(
            self.node_of_rank, self.factor, self.config.placement, allow_same_node=True
        )
        if self.factor > len(set(self.node_of_rank)) and rank == 0:
            log.warning(
                "replication.factor=%d but only %d node(s): replicas are kept by other "
                "processes, so a process failure is recoverable but the loss of a node is not",
                self.factor, len(set(self.node_of_rank)),
            )
        self.sources = sources_of(self.holders)
        # Per-step marks (.marks), carried over like the snapshots, and their exchange
        self.marks = (previous.marks if previous is not None else None) or MarkBook(state)
        self.mark_exchange: MarkExchange | None = None  # (started by .live_rollback)
        self._inflight: Future | None = None
        self._rounds = _RoundThread()
        self.drift = DriftWatch()  # data-parallel replicas drifting apart (this generation)
        self.last_round: RoundStats | None = None
        self.check_budget(expected)

    def _device_tier(self, device: torch.device | None) -> DeviceTier | None:
        """The device tier ``replication.device`` asks for (``None``: host only).
        Replicas held for peers stay in host memory whatever the setting."""
        if self.config.device in HOST_SETTINGS:
            return None
        return DeviceTier(device, required=self.config.device == "cuda",
                          headroom=self.config.device_headroom)

    # -- memory ----------------------------------------------------------------------
    def plan(self, state_bytes: int) -> MemoryPlan:
        # Every slot keeps a host buffer, the device tier's too: no staging beyond them.
        staging = 0
        durable = state_bytes if self._durable_staging else 0
        replica_sizes = tuple(self.state_bytes_of_rank[src] for src in self.sources[self.rank])
        return MemoryPlan(state_bytes, self.factor, staging, durable,
                          local_slots=len(self.engine.slots), replica_sizes=replica_sizes)

    def _expected_state_bytes(self) -> int:
        """The state's size now plus the optimizer state its first step will create."""
        size = flatten(self.state.measure()).nbytes
        return size + sum(
            lazy_optimizer_bytes(obj)
            for _, obj in self.state
            if isinstance(obj, torch.optim.Optimizer)
        )

    def check_budget(self, state_bytes: int | None = None) -> MemoryPlan:
        """Check the budget against the state's expected size (``state_bytes``, measured
        now if not given), this rank's replicas (as placed, each the size its source
        reported) and the staging buffers."""
        plan = self.plan(self._expected_state_bytes() if state_bytes is None else state_bytes)
        check_budget(plan, self.memory, self.local_world_size, self._budget)
        return plan

    def log_budget(self) -> int:
        """Update log bytes this rank may hold per source (ADR 0049): the budget's rest."""
        return max(0, self._budget - self.check_budget().total_bytes) // max(
            1, len(self.sources[self.rank]))

    def _check_layout_budget(self, layout: SnapshotLayout) -> None:
        check_budget(self.plan(layout.nbytes), self.memory, self.local_world_size, self._budget)

    # -- training-loop API -----------------------------------------------------------
    def capture(self, step: int) -> SnapshotSlot:
        """Wait for the round in flight, then copy the live state of ``step`` into a free
        slot (the training loop's stall)."""
        self.wait()
        if self._fault_hook is not None:
            self._fault_hook("snapshot", step)
        return self.engine.capture(step)

    def snapshot(self, step: int, *, urgent: bool = False, captured: SnapshotSlot | None = None
                 ) -> float:
        """Capture ``step`` and start replicating it; returns the seconds the loop stalled.
        ``urgent``: the caller waits for the commit (a recovery): the copy is not niced.
        ``captured``: the step's slot, captured already (a live rollback sends from it)."""
        t0 = time.perf_counter()
        slot = captured if captured is not None else self.capture(step)
        self.wait()
        self._inflight = self._rounds.submit(self._round, slot, urgent)
        return time.perf_counter() - t0

    def snapshot_due(self, step: int) -> bool:
        """Whether ``step`` is snapshotted by default: every ``replication.every_n_steps``-th."""
        return step % self.config.every_n_steps == 0

    def maybe_snapshot(self, step: int) -> float | None:  # every every_n_steps-th step
        return self.snapshot(step) if self.snapshot_due(step) else None

    def settled_round(self) -> RoundStats | None:
        """The newest round known to have committed, without waiting: the one in flight
        if it has already ended well, else the last one waited for. Lets the durable tier
        hand a committed snapshot to its writer as soon as its round ends, not at the
        next snapshot (a live rollback must not skip a save still waiting, ADR 0039)."""
        fut = self._inflight
        if fut is not None and fut.done() and fut.exception() is None:
            return fut.result()
        return self.last_round

    def wait(self) -> RoundStats | None:
        """Block until the in-flight round is committed; re-raise its failure.

        Gives up early, with :class:`ReplicationError`, when ``should_abort()`` turns
        true (a failure was declared elsewhere and the round may never complete).
        """
        fut, self._inflight = self._inflight, None
        if fut is None:
            return None
        try:
            while True:
                try:
                    self.last_round = fut.result(timeout=0.05)
                    break
                except FutureTimeout:
                    if self.should_abort is not None and self.should_abort():
                        raise ReplicationError(
                            "replication round abandoned: a failure was declared"
                        ) from None
        except (TransportError, ChecksumMismatch, RuntimeError) as exc:
            if isinstance(exc, ReplicationError):
                raise
            raise ReplicationError(str(exc)) from exc
        return self.last_round

    def committed_step(self) -> int:
        """The newest step every copy holds: the store's sealed record, or the newest
        step this rank's own agreement returned for when the record lags behind it (it
        is written in the background: :mod:`.commit_record`)."""
        return max(committed_step(self._store, self._committed_key), self.known_committed)

    @property
    def known_committed(self) -> int:
        """The newest step this rank learned is committed (and keeps the slot of), in
        this timeline: a recovery's handover resets it to the target."""
        return self.engine.protected_step

    def _record_committed(self, step: int) -> None:
        """Rank 0, every acknowledgement in: record the committed step in the store, in
        the background (the planner reads it from the join records too)."""
        assert self._recorder is not None
        self._recorder.record(step)

    def _keep(self, step: int) -> None:  # committed: its slot and replicas survive
        self.engine.protect(step)
        self.replicas.protect(step)

    def _commit(self, step: int) -> None:
        """Block until ``step`` is committed on every copy."""
        if self.tree is not None:
            self.tree.agree(step)
            return
        assert self.ledger is not None
        self.ledger.ack(step)
        self.ledger.wait_committed(step)
        if self.rank == 0 and step > 0:
            self.ledger.forget(step - 2 * self.config.every_n_steps)

    def restore_local(self, step: int) -> None:
        self.engine.restore(step)  # this rank's own snapshot of ``step``

    def close(self) -> None:
        try:
            self.wait()
            if self._recorder is not None and not self._recorder.flush(RECORD_FLUSH_S):
                log.warning("the committed-step record did not reach the job store within "
                            "%.0fs of the end", RECORD_FLUSH_S)
        finally:
            if self._recorder is not None:
                self._recorder.stop()
            self._rounds.stop()
            if self.mark_exchange is not None:
                self.mark_exchange.stop()
            self.channel.close()

    def abandon(self) -> SideChannel:
        """Stop using this replicator without waiting for an in-flight round.

        Gloo cannot abort an operation, so a round blocked on a dead peer stays blocked
        until its timeout; we leave it to finish (or fail) on its own thread and return
        the side channel, which the caller must keep referenced until then. Snapshots
        and replicas stay valid and are handed to the next generation.
        """
        self._inflight = None
        if self._recorder is not None:
            self._recorder.stop()  # a rollback follows: no record of this timeline after it
        self._rounds.stop()  # ends once the abandoned round, if any, gives up
        if self.mark_exchange is not None:
            self.mark_exchange.stop()
        self.channel.abort()  # its waits give up within a poll interval
        return self.channel

    # -- the background round --------------------------------------------------------
    def _round(self, slot: SnapshotSlot, urgent: bool = False) -> RoundStats:
        t0 = time.perf_counter()
        pending = slot.pending  # read once: a recapture may reset it (see seal)
        overlapped = pending.nbytes if pending is not None else 0
        meta = self.engine.seal(slot, low_priority=not urgent)  # overlapped copy, niced
        t_sealed = time.perf_counter()
        sent, received, skipped = self._exchange(meta, slot)
        if self._fault_hook is not None:
            self._fault_hook("replication", meta.step)
        t_moved = time.perf_counter()
        self._commit(meta.step)
        self._keep(meta.step)  # the tree commit did it already, before telling children
        self.twins = frozenset()  # every copy of a step exists now: real replicas serve
        return RoundStats(
            meta.step, t_sealed - t0, t_moved - t_sealed, time.perf_counter() - t_moved,
            sent, received, skipped, overlapped,
        )

    def _announce(self, meta: SnapshotMeta, meta_len: int) -> list[tuple[int, int, set[int]]]:
        n = len(meta.layout.segments)
        if n > MAX_SEGMENTS:
            raise ReplicationError(f"{n} state entries; at most {MAX_SEGMENTS} are supported")
        ann = torch.zeros(_ANN_HEADER + MAX_SEGMENTS, dtype=torch.int64)
        ann[0], ann[1], ann[2] = meta.step, meta_len, n
        for i in range(n):
            ann[_ANN_HEADER + i] = meta.fingerprint(i)
        peers = []
        ordered: list[list[int]] = []
        for t in self.channel.allgather(ann):
            vals = t.tolist()
            count = vals[2]
            ordered.append(vals[_ANN_HEADER : _ANN_HEADER + count])
            peers.append((vals[0], vals[1], set(ordered[-1])))
        if all(len(fps) == n for fps in ordered):  # the same entries everywhere
            self.drift.observe(meta.step, [seg.name for seg in meta.layout.segments], ordered)
        steps = {p[0] for p in peers}
        if steps != {meta.step}:
            raise ReplicationError(f"ranks disagree on the step being replicated: {sorted(steps)}")
        return peers

    def _exchange(self, meta: SnapshotMeta, slot: SnapshotSlot) -> tuple[int, int, int]:
        if self.factor == 1:
            return 0, 0, 0  # no replicas: the commit count alone keeps ranks in step
        meta_bytes = meta.to_bytes()
        peers = self._announce(meta, len(meta_bytes))
        chunk = self.config.chunk_bytes
        meta_t = torch.frombuffer(bytearray(meta_bytes), dtype=torch.uint8)
        my_fps = peers[self.rank][2]
        sends: list = []
        sent = skipped = 0
        for h in self.holders[self.rank]:
            sends += self.channel.post_send(meta_t, h, _META_TAG, len(meta_bytes))
            for i, seg in enumerate(meta.layout.segments):
                # Tensor-less segments travel entirely inside the metadata.
                if seg.nbytes == 0 or (
                    self.config.dedupe and meta.fingerprint(i) in peers[h][2]
                ):
                    skipped += 1
                    continue
                seg_bytes = slot.segment_bytes(seg.name)
                sends += self.channel.post_send(seg_bytes, h, tags.segment(i), chunk)
                sent += seg.nbytes
        received = 0
        for src in self.sources[self.rank]:
            received += self._receive_replica(src, peers[src][1], my_fps)
        self.channel.wait(sends, "send")
        return sent, received, skipped

    def _receive_replica(self, src: int, meta_len: int, my_fps: set[int]) -> int:
        meta_buf = torch.empty(meta_len, dtype=torch.uint8)
        self.channel.wait(self.channel.post_recv(meta_buf, src, _META_TAG, meta_len), "metadata")
        meta = SnapshotMeta.from_bytes(meta_buf.numpy().tobytes())
        shared = {seg.name for i, seg in enumerate(meta.layout.segments)
                  if seg.nbytes and self.config.dedupe and meta.fingerprint(i) in my_fps}
        received = sum(seg.nbytes for seg in meta.layout.segments if seg.name not in shared)
        rslot = self.replicas.writable(src, meta.layout.nbytes, received)
        assert rslot.buffer is not None
        chunk = self.config.chunk_bytes
        # Per segment received (a tensor-less one has only its skeleton and layout to
        # verify), its chunks as (tag, view of the slot), in the sender's order.
        segments = [(seg.name, [(tags.segment(i) + j,
                                 rslot.buffer[a : min(a + chunk, seg.offset + seg.nbytes)])
                                for j, a in enumerate(range(seg.offset, seg.offset + seg.nbytes,
                                                            chunk))])
                    for i, seg in enumerate(meta.layout.segments) if seg.name not in shared]
        what = f"replica of rank {src}"
        if rslot.on_device:  # through host chunks, hashed as they land
            receive_staged(self.channel, src, segments, meta, self.replicas.ring(), what)
        else:
            pending = [(name, self.channel.post_recv_pieces([v for _, v in pieces], src,
                                                            pieces[0][0]) if pieces else [])
                       for name, pieces in segments]
            # Each chunk is hashed as soon as it lands, overlapping hashing with the
            # transfer.
            verify_as_they_land(pending, meta, lambda w: self.channel.wait([w], what), what)
        self.replicas.adopt(rslot, meta, shared=frozenset(shared))
        return received

    # -- recovery --------------------------------------------------------------------
    def held(self) -> tuple[list[int], dict[int, list[int]]]:
        """The steps this rank holds: its own snapshots, and replicas per source rank
        (what its join record tells the recovery plan)."""
        own, held = self.engine.held_steps(), self.replicas.held_steps()
        return own, {**held, **{twin: own for twin in self.twins}}

    def recover(self, target_step: int, providers: dict[int, int]) -> HandoverResult:
        """Take part in a recovery's handover to ``target_step`` (see
        :mod:`.handover`): serve the replicas this rank provides, receive its
        own state if it is a newcomer, restore, reseed, meet the others."""
        return hand_over(
            channel=self.channel, engine=self.engine, replicas=self.replicas,
            serve=self.replica_source, rank=self.rank, target_step=target_step,
            providers=providers, holders=self.holders, sources=self.sources[self.rank],
            factor=self.factor, chunk_bytes=self.config.chunk_bytes,
            dedupe=self.config.dedupe)

    def rolled_back(self, target_step: int) -> None:
        """The state went back to ``target_step`` (from memory or a durable checkpoint):
        steps this rank snapshotted after it are replays from now on
        (:mod:`.replay_check`)."""
        self.engine.replay.rolled_back(target_step)

    def take_replay_differences(self) -> list[tuple[int, list[str]]]:
        """Replayed steps whose snapshot differed from the first run's, since last asked."""
        return self.engine.replay.take_differences()

    @property
    def fence_wait_s(self) -> float:
        """Seconds optimizer steps have waited for an overlapped copy, in all."""
        return self.engine.fence_wait_s

    def own_snapshot(self, step: int) -> SnapshotSlot:
        """This rank's snapshot slot of ``step`` (the durable writer persists from it)."""
        return self.engine.slot_for(step)

    def hold_slot(self, slot: SnapshotSlot, wait: Callable[[], None]) -> None:
        """Keep ``slot`` out of captures until ``unhold_slot``; a capture that needs it
        calls ``wait`` first (a durable save still reading it)."""
        self.engine.hold(slot, wait)

    def unhold_slot(self, slot: SnapshotSlot, wait: Callable[[], None]) -> None:
        self.engine.unhold(slot, wait)

    # -- reading replicas ------------------------------------------------------------
    def replica_source(self, src: int, step: int) -> Served:
        """The metadata of the replica of ``src`` at ``step`` held here, and where each of
        its segments lies (its slot, or this rank's own snapshot for shared segments),
        for sending without a copy. Not verified here: the receiver checks every
        segment as it lands. The slots stay put while the recovery runs (no round)."""
        if src in self.twins:  # its state is this rank's own
            mine = self.engine.slot_for(step)
            return Served(mine.meta(), lambda seg: mine.segment_bytes(seg.name))
        rslot = self.replicas.get(src, step)
        assert rslot.meta is not None and rslot.buffer is not None
        own = self.engine.slot_for(step) if rslot.shared else None
        buffer, shared = rslot.buffer, rslot.shared

        def source(seg: SegmentLayout) -> torch.Tensor:
            if seg.name in shared:
                assert own is not None
                return own.segment_bytes(seg.name)
            return buffer[seg.offset : seg.offset + seg.nbytes]

        return Served(rslot.meta, source, self.replicas.ring() if rslot.on_device else None)

    def replica_buffer(self, src: int, step: int) -> tuple[SnapshotMeta, torch.Tensor]:
        """The full snapshot bytes of ``src`` at ``step`` as held here, verified, in a fresh
        buffer (valid while later rounds reuse the slots); shared segments from our own."""
        rslot = self.replicas.get(src, step)
        assert rslot.meta is not None and rslot.buffer is not None
        out = rslot.host_copy()
        if rslot.shared:
            own = self.engine.slot_for(step)
            for name in rslot.shared:
                seg = rslot.meta.layout.segment(name)
                out[seg.offset : seg.offset + seg.nbytes].copy_(own.segment_bytes(name))
        verify_segments(out, rslot.meta)
        return rslot.meta, out
