"""Sending and receiving the per-step marks (:mod:`replication.replica_protocol.marks`)
over a generation's side channel: each rank to the holders of its replicas, in messages
whose sizes both sides know in advance, so that a holder's receive is always posted and
the training thread never waits on a peer."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence

import torch

from replication.replica_protocol.marks import MAX_MARK_BYTES, Mark, MarkBook
from replication.side_channel import tags
from replication.side_channel.transport import SideChannel, TransportError
from replication.side_channel.work_waiter import Waiters

SENDS_IN_FLIGHT = 8  # marks not yet taken by a holder before this rank skips one
FIRST_CAPACITY = 64 << 10  # bytes of the first mark message (see MarkExchange)
_HEADER = 64  # step, length, next message's size (three int64), padded to MARK_ALIGN


def _capacity(nbytes: int) -> int:
    """The size of the message after one that carried ``nbytes``: room to grow a
    quarter, in whole pages, and never under :data:`FIRST_CAPACITY`."""
    return max(FIRST_CAPACITY, -(-(nbytes + nbytes // 4) // 4096) * 4096)


def first_capacity(state_bytes: int) -> int:
    """The receive posted for a rank's first mark message: room for a sharded job's
    mark, whose gradients are at most the state's size (parameters and optimizer
    state), plus the small part. Untouched pages of it cost no memory."""
    return _capacity(state_bytes + MAX_MARK_BYTES)


class MarkExchange:
    """One generation's sending and receiving of marks over its side channel.

    A mark travels as one message of a size both sides know in advance, so a holder
    always has the receive for the next one posted and the bytes move in gloo's own
    threads as soon as they are sent, whatever the holder's Python threads are doing:
    ``[step, length, next size]`` (three int64), the mark, padding. Each message names
    the size of the next (:func:`_capacity` of this one's); a mark that does not fit
    is not sent, and an empty message (step -1) carries the larger size instead. The
    first message is as large as its mark needs, up to the receive posted for it
    (``first``): a rank decides what its marks hold (data-parallel or sharded,
    :meth:`MarkBook.declare`) only once its job has declared its entries, which may
    come after the exchange starts, so neither side's size may depend on that.

    The training thread never blocks in gloo, nor waits for its marks to leave: it
    posts the sends and a daemon thread waits for them (gloo's point-to-point works end
    only in ``wait``); a mark whose holders have not yet taken :data:`SENDS_IN_FLIGHT`
    earlier ones is skipped (the holder keeps an older mark, and a failure then takes
    the snapshot path). One daemon thread per
    source receives its marks. Every wait goes through waiters that :meth:`stop`
    releases at once (:mod:`replication.side_channel.work_waiter`), so neither an abort nor the end
    of the job waits on a peer."""

    def __init__(self, channel: SideChannel, rank: int, holders: Sequence[int],
                 sources: Sequence[int], book: MarkBook,
                 first: Callable[[int], int] = lambda rank: FIRST_CAPACITY) -> None:
        """``first(rank)``: the receive posted for ``rank``'s first message, known to
        both sides; its first message is no larger."""
        self.channel = channel
        self.rank = rank
        self.holders = [h for h in holders if h != rank]
        self.book = book
        self.skipped = 0
        self._first = first
        self._capacity = 0  # the size of the next message sent (0: the first is to come)
        self._posted = 0
        self._ended = 0  # sends whose wait returned (or failed), counted by the reaper
        self._sends: queue.SimpleQueue[tuple[list, threading.Event, torch.Tensor] | None] = \
            queue.SimpleQueue()
        self._pool: list[torch.Tensor] = []  # sent messages, reused (see _message)
        self._reserved: torch.Tensor | None = None  # the next message (see reserve)
        self._last_sent: threading.Event | None = None  # set when the newest mark left
        self._pool_lock = threading.Lock()
        self._waiters = Waiters("checkpointless-marks-wait", channel.timeout)
        self._threads = [threading.Thread(target=self._receive, args=(src,), daemon=True,
                                          name=f"checkpointless-marks-{src}")
                         for src in sources if src != rank]
        self._threads.append(threading.Thread(target=self._reap, daemon=True,
                                              name="checkpointless-marks-sent"))
        for t in self._threads:
            t.start()

    def reserve(self, nbytes: int) -> torch.Tensor | None:
        """Where a mark of ``nbytes`` (:meth:`Mark.to_tensor`'s) goes in the next
        message, so that :meth:`MarkBook.capture` writes it there and :meth:`send` has
        nothing to copy; ``None`` when that mark will not be sent whole (see
        :meth:`send`). Never the message holding this rank's newest mark: the book
        keeps it (a survivor reloads its small part from it)."""
        self._release()
        if not self.holders or self._posted - self._ended >= SENDS_IN_FLIGHT:
            return None
        capacity = self._capacity or min(self._first(self.rank), _capacity(_HEADER + nbytes))
        if _HEADER + nbytes > capacity:
            return None
        self._reserved = self._message(capacity)
        return self._reserved[_HEADER : _HEADER + nbytes]

    def _release(self) -> None:
        """A reserved message that no mark was sent in goes back to the pool."""
        if self._reserved is not None:
            with self._pool_lock:
                self._pool.append(self._reserved)
            self._reserved = None

    def send(self, mark: Mark) -> bool:
        """Post ``mark`` to every holder; False if it was skipped (see the class)."""
        if not self.holders:
            return False
        if self._posted - self._ended >= SENDS_IN_FLIGHT:
            self.skipped += 1
            self._release()
            return False
        raw = mark.meta_bytes
        nbytes = Mark.body_offset(len(raw)) + mark.buffer.numel()
        following = _capacity(_HEADER + nbytes)
        if not self._capacity:
            self._capacity = min(self._first(self.rank), following)
        fits = _HEADER + nbytes <= self._capacity
        reserved, self._reserved = self._reserved, None
        in_place = fits and reserved is not None and reserved.numel() == self._capacity \
            and mark.lies_in(reserved[_HEADER:], raw)
        if reserved is not None and not in_place:
            with self._pool_lock:
                self._pool.append(reserved)
        msg = reserved if in_place else self._message(self._capacity)
        msg[:24] = torch.tensor([mark.step if fits else -1, nbytes if fits else 0,
                                 following], dtype=torch.int64).view(torch.uint8)
        if fits and not in_place:  # a sharded mark is its gradient shards: written in place
            mark.write_into(msg[_HEADER:], raw)
        works: list = []
        try:
            for h in self.holders:
                works += self.channel.post_send(msg, h, tags.MARK_DATA, 1 << 30)
        except TransportError:
            return False  # the generation is ending: its recovery says what happened
        self._capacity = following
        self._posted += 1
        sent = threading.Event()
        self._sends.put((works, sent, msg))  # the bytes live until sent
        # Not waited for: a holder's receive is always posted, so the bytes leave as
        # fast as the link takes them, and a wait here would not make them leave
        # sooner. A rank lost before they did (within a shard's transfer time of the
        # step's end) takes this mark with it, and that recovery replays.
        self._last_sent = sent
        if not fits:
            self.skipped += 1
        return fits

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for every mark posted so far to have left; whether
        they have (the fault injector's kills come after it, see
        :class:`recovery.faults.injection.FaultInjector`)."""
        return self._last_sent is None or self._last_sent.wait(timeout)

    def stop(self) -> None:
        """End the threads now (the generation is over, or the job)."""
        self._sends.put(None)
        self._waiters.abandon()

    def _message(self, capacity: int) -> torch.Tensor:
        """A message buffer of ``capacity`` bytes: a sent one reused (a sharded job's
        are megabytes, and fresh pages cost more than the copy into them), or a new
        one, zeroed (its padding then never carries stale memory). Never the one the
        book's newest mark lies in (:meth:`reserve`)."""
        own = self.book.own
        at = own.buffer.data_ptr() if own is not None and own.buffer.numel() else -1
        with self._pool_lock:
            for i, buf in enumerate(self._pool):
                start = buf.data_ptr()
                if buf.numel() == capacity and not start <= at < start + buf.numel():
                    return self._pool.pop(i)
        return torch.zeros(capacity, dtype=torch.uint8)

    def _reap(self) -> None:
        while (item := self._sends.get()) is not None:
            works, sent, msg = item
            try:
                for w in works:
                    self._waiters.wait(w)
                with self._pool_lock:  # sent to every holder: free for the next mark
                    self._pool = [*self._pool[-1:], msg]
            except Exception:  # a dead holder, an abort: the recovery deals with it
                pass
            self._ended += 1
            sent.set()

    def _receive(self, src: int) -> None:
        try:
            capacity = self._first(src)
            buf = torch.empty(capacity, dtype=torch.uint8)
            works = self.channel.post_recv(buf, src, tags.MARK_DATA, 1 << 30)
            while True:
                for w in works:
                    self._waiters.wait(w)
                step, nbytes, capacity = (int(x) for x in buf[:24].view(torch.int64))
                landed = buf
                buf = torch.empty(capacity, dtype=torch.uint8)  # the next one, posted first
                works = self.channel.post_recv(buf, src, tags.MARK_DATA, 1 << 30)
                if step >= 0:
                    mark = Mark.from_tensor(landed[_HEADER : _HEADER + nbytes], copy=False)
                    if mark.step == step:
                        self.book.store_peer(src, mark)
        except Exception:  # stopped, aborted, or a malformed mark: this generation is over
            return
