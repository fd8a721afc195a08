"""The tree commit (replication.replica_protocol.commit_tree): its shape, and the agreement run by
threads
over an in-memory transport. The same code over gloo runs in every multi-process test
(tests/test_replication_mp.py, the fault tests): this file checks what those cannot
force, the orderings."""

from __future__ import annotations

import queue
import threading

import pytest

from replication.replica_protocol.commit_tree import (
    ACK,
    DONE,
    CommitDisagreement,
    TreeCommit,
    children_of,
    depth_of,
    parent_of,
)


class Abandoned(RuntimeError):
    pass


class QueueTransport:
    """One FIFO per (src, dst, kind); ``abort()`` makes every blocked receive raise, as
    an aborted side channel does."""

    def __init__(self) -> None:
        self.queues: dict[tuple[int, int, str], queue.Queue] = {}
        self.lock = threading.Lock()
        self.aborted = threading.Event()
        self.sent: list[tuple[int, int, str, int]] = []

    def _q(self, src: int, dst: int, kind: str) -> queue.Queue:
        with self.lock:
            return self.queues.setdefault((src, dst, kind), queue.Queue())

    def endpoint(self, rank: int) -> _Endpoint:
        return _Endpoint(self, rank)

    def abort(self) -> None:
        self.aborted.set()


class _Endpoint:
    def __init__(self, net: QueueTransport, rank: int) -> None:
        self.net, self.rank = net, rank

    def send(self, dst: int, kind: str, step: int) -> None:
        with self.net.lock:
            self.net.sent.append((self.rank, dst, kind, step))
        self.net._q(self.rank, dst, kind).put(step)

    def recv(self, src: int, kind: str) -> int:
        q = self.net._q(src, self.rank, kind)
        while True:
            if self.net.aborted.is_set():
                raise Abandoned(f"rank {self.rank}: receive from {src} abandoned")
            try:
                return q.get(timeout=0.01)
            except queue.Empty:
                continue


@pytest.mark.parametrize("world", [1, 2, 5, 17, 64, 341])
def test_the_tree_covers_every_rank_once(world):
    seen = {0}
    for r in range(world):
        for c in children_of(r, world):
            assert parent_of(c) == r and c not in seen
            seen.add(c)
    assert seen == set(range(world))
    deepest = max((_depth(r) for r in range(world)), default=0)
    assert depth_of(world) == deepest


def _depth(rank: int) -> int:
    d = 0
    while (p := parent_of(rank)) is not None:
        rank, d = p, d + 1
    return d


def test_depth_grows_with_the_logarithm():
    assert [depth_of(n) for n in (1, 5, 6, 64, 1024, 16384)] == [0, 1, 2, 3, 5, 7]


def _run(world: int, steps: list[int], net: QueueTransport, records: list,
         entered: dict | None = None, skip: int | None = None,
         ) -> tuple[dict[int, BaseException], list[threading.Thread]]:
    """Every rank (but ``skip``) agrees on ``steps`` in order, each on its own thread."""
    errors: dict[int, BaseException] = {}

    def record(step: int) -> None:
        # Every rank must have entered agree(step) before the root records it.
        records.append((step, None if entered is None else sorted(entered.get(step, ()))))

    def rank_main(rank: int) -> None:
        tree = TreeCommit(rank, world, net.endpoint(rank), record)
        try:
            for s in steps:
                if entered is not None:
                    with net.lock:
                        entered.setdefault(s, set()).add(rank)
                tree.agree(s)
                assert tree.committed == s
        except BaseException as exc:  # reported to the test
            errors[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True)
               for r in range(world) if r != skip]
    for t in threads:
        t.start()
    return errors, threads


@pytest.mark.parametrize("world", [1, 2, 7, 64])
def test_every_step_is_recorded_once_after_every_rank_vouched_for_it(world):
    net, records, entered = QueueTransport(), [], {}
    errors, threads = _run(world, [1, 2, 3], net, records, entered)
    for t in threads:
        t.join(20)
    assert not errors, errors
    assert records == [(s, list(range(world))) for s in (1, 2, 3)]
    # 2 (world - 1) messages per step: one acknowledgement up, one "committed" down.
    assert len(net.sent) == 3 * 2 * (world - 1)
    assert sum(1 for m in net.sent if m[2] == ACK) == sum(1 for m in net.sent if m[2] == DONE)


@pytest.mark.parametrize("missing", [0, 3, 9])
def test_a_rank_that_never_acknowledges_leaves_the_step_uncommitted(missing):
    """A rank dead mid-agreement: nothing is recorded, whatever its place in the tree,
    and every other rank's wait ends when the channel is aborted (a declared failure)."""
    net, records = QueueTransport(), []
    errors, threads = _run(10, [5], net, records, skip=missing)
    for t in threads:
        t.join(0.3)
    assert records == []  # never runs ahead of what every copy holds
    assert all(t.is_alive() for t in threads)  # waiting, not deciding anything
    net.abort()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)
    assert set(errors) == set(range(10)) - {missing}
    assert all(isinstance(e, Abandoned) for e in errors.values())
    assert records == []


def test_a_child_on_another_step_is_a_disagreement_not_a_commit():
    net, records = QueueTransport(), []
    net.endpoint(1).send(0, ACK, 4)  # rank 1 acknowledges step 4 while 0 agrees on 5
    tree = TreeCommit(0, 2, net.endpoint(0), records.append)
    with pytest.raises(CommitDisagreement, match="rank 1's ack is for step 4"):
        tree.agree(5)
    assert records == [] and tree.committed == -1


def test_a_rank_outside_the_world_is_refused():
    with pytest.raises(ValueError, match="outside a world of 4"):
        TreeCommit(4, 4, QueueTransport().endpoint(4), lambda s: None)


@pytest.mark.parametrize("world", [2, 7, 21])
def test_a_rank_acts_on_a_commit_before_its_children_learn_of_it(world):
    """``decided(step)`` runs on every rank before it sends "committed" to any child,
    and on the root before the record: a rank that knows a step committed has
    ancestors that all kept it. Without the order, the root's round thread, descheduled
    between telling rank 1 and keeping the step's slot, once made a recovery go back to
    step 3 when rank 1 (then killed) had learnt that step 6 was committed."""
    net, order = QueueTransport(), []

    class Recording(_Endpoint):
        def send(self, dst: int, kind: str, step: int) -> None:
            if kind == DONE:
                with net.lock:
                    order.append(("told", self.rank, dst, step))
            super().send(dst, kind, step)

    def rank_main(rank: int) -> None:
        def decided(step: int) -> None:
            with net.lock:
                order.append(("kept", rank, step))

        def record(step: int) -> None:
            with net.lock:
                order.append(("recorded", rank, step))

        tree = TreeCommit(rank, world, Recording(net, rank), record, decided=decided)
        for s in (6, 9):
            tree.agree(s)

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True)
               for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    for step in (6, 9):
        kept = {e[1]: i for i, e in enumerate(order) if e[0] == "kept" and e[-1] == step}
        assert sorted(kept) == list(range(world))
        for i, e in enumerate(order):
            if e[0] == "told" and e[-1] == step:
                assert kept[e[1]] < i, (e, order)  # the sender kept it first
            if e[0] == "recorded" and e[-1] == step:
                assert kept[0] < i
