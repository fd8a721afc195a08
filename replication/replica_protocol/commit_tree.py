"""The per-step commit without a central store: agreement up and down a tree of ranks.

A step counts as committed only once every copy of it exists: every rank holds its own
sealed snapshot of the step and has received and verified every replica it is meant to
hold. The first version counted acknowledgements in the job store (every rank ``add``
to one key, then a wait on it: :class:`replication.replica_protocol.commit.CommitLedger`). That
costs the
store O(world) operations per step, serialised on its one serving thread; at 1,024
clients one commit took 193 ms, longer than many training steps.

Here the ranks agree among themselves, over the replication side channel they already
share, along a ``FANOUT``-ary tree laid out by rank (rank ``r``'s parent is
``(r - 1) // FANOUT``):

1. **up**: a rank whose own copies of step ``s`` are complete waits for an
   acknowledgement of ``s`` from each of its children, then acknowledges ``s`` to its
   parent. An acknowledgement therefore vouches for the whole subtree below it.
2. **root**: when rank 0 has every child's acknowledgement, every copy of ``s`` exists.
   It records ``s`` as the committed step, sealed, in the job store: **one** store
   write per step for the whole job, which a recovery reads as before
   (:data:`replication.replica_protocol.commit.COMMITTED_KEY`).
3. **down**: rank 0 then tells its children, which tell theirs, that ``s`` is
   committed; a rank returns from :meth:`TreeCommit.agree` once it knows.

Latency is ``2 * depth`` message hops, depth ``ceil(log_FANOUT(world))``: it grows with
the logarithm of the world, and no shared server sees more than one request per step.

Failure cases (ADR 0022):

- *A rank dies mid-agreement.* Its parent never gets its acknowledgement (or its
  children never get "committed"), so the step is never recorded: the committed step
  cannot run ahead of what every copy holds. The waits end when the side channel is
  aborted (a failure was declared: :meth:`replication.side_channel.transport.SideChannel.abort`),
  or at the channel's timeout, as the store count's wait did.
- *Rank 0 dies after recording the step, before passing "committed" down.* The store
  says ``s`` is committed and every copy of ``s`` exists (that is what the
  acknowledgements vouched for); the other ranks simply never learned it. A recovery
  targets ``s``, which they hold. The same race existed with the store count (the
  last acknowledger wrote the record while others were still waiting for it).
- *A slow rank* holds back the commit of every step until it catches up, as before:
  rounds are sequential on each rank, so no rank can be more than one round ahead.
- *A partition* looks like a dead rank to whichever side waits; the job's failure
  detection (heartbeats, leases) declares the failure, which aborts the channel.
- *Disagreement* (a child acknowledging another step) is a protocol error, reported
  as :class:`CommitDisagreement`, never papered over.

The protocol is written against :class:`CommitTransport`, two blocking calls, so that
the scale harness (``benchmarks/bench_scale.py``) runs this same code with thousands of
simulated ranks on an in-memory transport.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from replication.errors import CheckpointlessError
from replication.side_channel import tags

#: Children per rank. Four keeps the tree shallow (depth 5 at 1,024 ranks, 7 at 16,384)
#: while a parent's receives stay few enough that their cost does not dominate a hop.
FANOUT = 4

ACK = "ack"  #: a child's acknowledgement of a step (its subtree holds every copy)
DONE = "done"  #: a parent's word that a step is committed


class CommitDisagreement(CheckpointlessError, RuntimeError):
    """A neighbour in the commit tree spoke of another step than the one being agreed."""


class CommitTransport(Protocol):
    """Point-to-point messages of one integer (a step), in order per (peer, kind)."""

    def send(self, dst: int, kind: str, step: int) -> None:
        """Deliver ``step`` to ``dst`` (returns once it is handed off)."""

    def recv(self, src: int, kind: str) -> int:
        """The next step ``src`` sent with ``kind``; blocks, raises if abandoned."""


def parent_of(rank: int, fanout: int = FANOUT) -> int | None:
    return None if rank == 0 else (rank - 1) // fanout


def children_of(rank: int, world_size: int, fanout: int = FANOUT) -> list[int]:
    first = fanout * rank + 1
    return list(range(first, min(first + fanout, world_size)))


def depth_of(world_size: int, fanout: int = FANOUT) -> int:
    """Hops from the deepest rank to the root."""
    depth, rank = 0, world_size - 1
    while rank > 0:
        rank, depth = (rank - 1) // fanout, depth + 1
    return depth


class TreeCommit:
    """One rank's part in agreeing that every copy of a step exists.

    ``record(step)`` is called on rank 0 only, once every acknowledgement is in: it
    writes the sealed committed step to the job store (the one store operation of a
    step). :attr:`committed` is the newest step this rank knows to be committed.

    ``decided(step)`` is called on every rank as soon as it knows the step committed,
    before it tells its children (and on rank 0 before the record): so a rank that
    knows a step committed has ancestors that all acted on it. A survivor's join record
    then never names an older committed step than a dead child knew (the root's
    round thread, descheduled between telling rank 1 and keeping the step's slot, once
    made a recovery go back to step 3 when rank 1 had learnt 6 was committed).
    """

    def __init__(self, rank: int, world_size: int, transport: CommitTransport,
                 record: Callable[[int], None], fanout: int = FANOUT,
                 decided: Callable[[int], None] = lambda step: None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a world of {world_size}")
        self.rank, self.world_size = rank, world_size
        self.transport = transport
        self.record, self.decided = record, decided
        self.parent = parent_of(rank, fanout)
        self.children = children_of(rank, world_size, fanout)
        self.committed = -1

    def agree(self, step: int) -> None:
        """This rank's copies of ``step`` are complete: block until ``step`` is
        committed everywhere (or raise the transport's error when abandoned)."""
        for child in self.children:
            self._expect(self.transport.recv(child, ACK), step, f"rank {child}'s ack")
        if self.parent is None:
            self.decided(step)
            self.record(step)
        else:
            self.transport.send(self.parent, ACK, step)
            self._expect(self.transport.recv(self.parent, DONE), step,
                         f"rank {self.parent}'s commit")
            self.decided(step)
        for child in self.children:
            self.transport.send(child, DONE, step)
        self.committed = step

    def _expect(self, got: int, step: int, what: str) -> None:
        if got != step:
            raise CommitDisagreement(
                f"rank {self.rank} agrees on step {step} but {what} is for step {got}: "
                "ranks replicate different steps"
            )


class SideChannelTransport:
    """:class:`CommitTransport` over a replication side channel (gloo send/recv of one
    int64), each kind on its own tag (:mod:`replication.side_channel.tags`); waits give up when the
    channel is aborted, like every other wait of a round."""

    _TAGS = {ACK: tags.COMMIT_ACK, DONE: tags.COMMIT_DONE}

    def __init__(self, channel) -> None:  # replication.side_channel.transport.SideChannel
        self.channel = channel

    def send(self, dst: int, kind: str, step: int) -> None:
        buf = torch.tensor([step], dtype=torch.int64)
        self.channel.wait(self.channel.post_send(buf.view(torch.uint8), dst, self._TAGS[kind],
                                                 8), f"commit {kind} to rank {dst}")

    def recv(self, src: int, kind: str) -> int:
        buf = torch.empty(1, dtype=torch.int64)
        self.channel.wait(self.channel.post_recv(buf.view(torch.uint8), src, self._TAGS[kind],
                                                 8), f"commit {kind} from rank {src}")
        return int(buf.item())
