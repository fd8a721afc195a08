"""Peer transport: a dedicated gloo process group for snapshot traffic.

Replication never shares the training process group, so its traffic cannot reorder or
block the training collectives, and it can be torn down and rebuilt on its own. A
buffer moves as fixed-size chunks that are all posted at once (each with its own tag),
so gloo streams them back to back instead of one blocking send per tensor.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from replication.errors import CheckpointlessError
from replication.side_channel.abortable_gloo import AbortableGloo
from replication.side_channel.work_waiter import Abandoned, Waiters

_POLL = datetime.timedelta(milliseconds=100)


class TransportError(CheckpointlessError, RuntimeError):
    """A peer transfer failed or timed out (usually: the peer died)."""


class WaitAbandoned(CheckpointlessError, RuntimeError):
    """``wait_polled`` gave up because ``should_stop()`` turned true."""


def wait_polled(
    work: object,
    timeout_s: float,
    should_stop: Callable[[], bool] = lambda: False,
    poll: datetime.timedelta = _POLL,
) -> None:
    """Wait for a c10d *collective* in short slices, so the caller can give up in between.

    For gloo collectives (all-reduce, all-gather) a ``wait(timeout)`` that times out
    leaves the operation pending, and a later wait still sees its real outcome. Never
    use it for send/recv: there a timed-out wait closes the connection. Raises the
    work's own error if it failed, :class:`TimeoutError` after ``timeout_s``,
    :class:`WaitAbandoned` once ``should_stop()`` is true.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if should_stop():
            raise WaitAbandoned("wait abandoned")
        started = time.monotonic()
        try:
            work.wait(poll)  # type: ignore[attr-defined]
            return
        except RuntimeError as exc:
            # The message is all there is: c10d's ``Work.wait(timeout)`` raises a plain
            # RuntimeError ("Operation timed out!"), and so does gloo for its own
            # timeout ("Timed out waiting ...") and a lost peer ("Connection closed by
            # peer"); no DistError subclass or code tells them apart (torch 2.13).
            if "timed out" not in str(exc).lower():
                raise
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(str(exc)) from exc
            if now - started < poll.total_seconds() / 2:  # a timeout that is final
                time.sleep(poll.total_seconds())


def _drop_group(handed: list[Any]) -> None:
    """Release an aborted side-channel group (see :meth:`SideChannel.abort`). Its last
    references die here: destroying a gloo group joins its worker threads, which lasts
    until the timeout of an operation its abort did not end, and blocks only this
    thread (measured: no other thread of the process stops meanwhile;
    ``tests/test_side_channel_teardown.py``).

    ``handed`` is ``[group, pg]``, emptied here: the aborting thread keeps no reference
    of its own. When it kept them as locals, this thread sometimes ended first, and the
    destruction then ran as the abort returned, in the caller: about one abort in 130
    stood still for the channel's timeout (120 s by default) in the runtime's teardown."""
    group, pg = handed.pop(0), handed.pop(0)
    group.release()
    del group, pg


def _chunks(buf: torch.Tensor, chunk_bytes: int) -> list[torch.Tensor]:
    n = buf.numel()
    return [buf[i : i + chunk_bytes] for i in range(0, n, chunk_bytes)] or [buf]


class SideChannel:
    """A gloo process group on its own store prefix, used only for replication."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        *,
        prefix: str = "checkpointless/side",
        timeout_s: float = 120.0,
        hostname: str | None = None,
        interrupted: Callable[[], str | None] | None = None,
    ) -> None:
        """``interrupted``: see :meth:`AbortableGloo.create` (a peer that joined the
        generation and then died never connects; a newer generation ends the wait)."""
        self.rank = rank
        self.world_size = world_size
        self._aborted = False
        self._lock = threading.Lock()  # issuing and aborting: nothing is issued after
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._waiters = Waiters("checkpointless-side-wait", self.timeout)
        self._group = AbortableGloo.create(dist.PrefixStore(prefix, store), rank, world_size,
                                           timeout_s, hostname, interrupted)
        self.pg = self._group.backend

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's copy of a same-shaped tensor."""
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._wait(self._issue(lambda pg: [pg.allgather([out], [tensor])], "allgather"),
                   "allgather")
        return out

    def barrier(self) -> None:
        self._wait(self._issue(lambda pg: [pg.barrier()], "barrier"), "barrier")

    def _issue(self, post: Callable[[object], list], what: str) -> list:
        """The works ``post(group)`` posts; refused once the channel is aborted."""
        failed = ""
        with self._lock:
            if self._aborted:
                raise TransportError(f"replication {what} abandoned")
            try:
                return post(self.pg)
            except RuntimeError as exc:  # gloo refuses to post on a pair a peer closed
                failed = str(exc)
        # raised out here, so no traceback holds the group
        raise TransportError(f"replication {what} failed: {failed}")

    def post_send(self, buf: torch.Tensor, dst: int, tag: int, chunk_bytes: int) -> list:
        """Post the chunked send of a contiguous byte buffer; returns the works."""
        return self.post_send_pieces(_chunks(buf, chunk_bytes), dst, tag)

    def post_send_pieces(self, pieces: Sequence[torch.Tensor], dst: int, tag: int) -> list:
        """Post the sends of one message made of several contiguous byte tensors (piece
        ``i`` with tag ``tag + i``); the receiver posts pieces of the same sizes."""
        return self._issue(lambda pg: [pg.send([c], dst, tag + i)  # type: ignore[attr-defined]
                                       for i, c in enumerate(pieces)], "send")

    def post_recv_pieces(
        self, pieces: Sequence[torch.Tensor], src: int, tag: int
    ) -> list[tuple[object, torch.Tensor]]:
        """The receiving side of :meth:`post_send_pieces`: each work with its piece."""
        works = self._issue(lambda pg: [pg.recv([c], src, tag + i)  # type: ignore[attr-defined]
                                        for i, c in enumerate(pieces)], "receive")
        return list(zip(works, pieces))

    def post_recv(self, buf: torch.Tensor, src: int, tag: int, chunk_bytes: int) -> list:
        """Post the chunked receive into a contiguous byte buffer; returns the works."""
        return [w for w, _ in self.post_recv_chunks(buf, src, tag, chunk_bytes)]

    def post_recv_chunks(
        self, buf: torch.Tensor, src: int, tag: int, chunk_bytes: int
    ) -> list[tuple[object, torch.Tensor]]:
        """Like :meth:`post_recv`, pairing each work with its chunk, so a caller can
        process (e.g. checksum) chunks in order while later ones are still arriving."""
        return self.post_recv_pieces(_chunks(buf, chunk_bytes), src, tag)

    def wait(self, works: Sequence, what: str = "transfer") -> None:
        self._wait(works, what)

    def abort(self) -> None:
        """Make every wait on this channel give up now, later ones at once: its sockets
        are shut down (:mod:`.abortable_gloo`: the peers' operations on them fail), and
        every caller waiting here is released, whether gloo ends its operation or not
        (:mod:`.work_waiter`)."""
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            handed: list[Any] = [self._group, self.pg]
            self.pg = None
        handed[0].abort()
        self._waiters.abandon()
        # Drop the group: an abandoned round's thread may still hold this channel while
        # it waits for a commit, and the group's threads must not live that long. The
        # references travel in ``handed`` only, which the dropping thread empties: none
        # may be left in this frame (see _drop_group).
        threading.Thread(target=_drop_group, args=(handed,), daemon=True,
                         name="checkpointless-side-drop").start()

    def _wait(self, works: Sequence, what: str) -> None:
        # Not polled: a gloo send/recv whose wait times out closes the pair ("Application
        # timeout caused pair closure"), so point-to-point waits use the full timeout,
        # on a waiter thread that an abort releases the caller from (work_waiter).
        try:
            for w in works:
                if self._aborted:
                    raise TransportError(f"replication {what} abandoned")
                self._waiters.wait(w)
        except Abandoned:
            raise TransportError(f"replication {what} abandoned") from None
        except TransportError:
            raise
        except Exception as exc:  # gloo raises RuntimeError subclasses
            raise TransportError(f"replication {what} failed: {exc}") from exc

    def close(self) -> None:
        """Drop the group. Gloo cannot abort in-flight ops; dropping is all we can do."""
        self._waiters.close()
        try:
            if self.pg is not None:
                self.pg.shutdown()
        except Exception:
            pass
