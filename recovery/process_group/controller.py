"""Binds every owned process group of this process to one generation, and retires the old.

:class:`~recovery.process_group.owned_group.ElasticProcessGroup` objects outlive generations;
something has to hold them all, so that a declared failure reaches each one
(:meth:`Controller.fail`) and the next generation rebinds each one, in the same order on
every member (:meth:`Controller.activate`). The same object builds each generation's
inner backends (:class:`_Inner`, over the job store) and frees a failed generation's
once their last operations have ended, so nothing of it keeps a thread or a socket. It
is also the creator torch calls for ``backend="checkpointless"``
(:func:`register_backend`).
"""

from __future__ import annotations

import hashlib
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from recovery.common.errors import CollectiveAborted
from recovery.generation.protocol import gen_prefix
from recovery.process_group import nccl_inner
from recovery.process_group.owned_group import BACKEND_NAME, ElasticProcessGroup
from replication.side_channel.abortable_gloo import AbortableGloo
from replication.side_channel.interruptible_store import StoreWaitInterrupted


class _Inner:
    """A generation's inner backend for one device type, abortable."""

    def __init__(self, kind: str, backend: Any, gloo: AbortableGloo | None) -> None:
        self.kind = kind
        self.backend = backend
        self.gloo = gloo

    def abort(self) -> None:
        if self.gloo is not None:
            self.gloo.abort()
        else:  # pragma: no cover - NCCL needs GPUs (the GPU check runs one rank)
            nccl_inner.abort(self.backend)


class Controller:
    """Binds every :class:`ElasticProcessGroup` of this process to one generation."""

    def __init__(self) -> None:
        self.store: dist.Store | None = None
        self.timeout_s = 60.0
        self.inner_backends: dict[str, str] = {"cpu": "gloo"}
        self.ordered_allreduce = False  # recovery.ordered_allreduce (ADR 0034)
        self.gen: int | None = None
        self.failure: str | None = None  # why collectives fail now, until activate()
        self.epoch = 0  # bumped by every fail(): a bind that raced with one is void
        self.local_collectives = 0
        self.ordered_sums = 0  # all-reduces summed in rank order (recovery.ordered_allreduce)
        self.nccl_fixed_algorithm = False  # recovery.nccl_fixed_algorithm (ADR 0034)
        self._groups: list[weakref.ref[ElasticProcessGroup]] = []
        self._lock = threading.Lock()
        self._graveyard: list[tuple[list[_Inner], list[Any]]] = []
        self._made_in_gen: dict[str, int] = {}
        self.on_retire_stuck: Callable[[Any], None] | None = None
        # A newer generation was declared (the runtime's watchdog): a generation's inner
        # backends stop waiting for a peer that may never connect (make_inner).
        self.should_abort: Callable[[], bool] = lambda: False

    def counters(self) -> dict[str, int]:
        """What the recovery event reports: collectives completed locally before joining,
        and all-reduces summed in rank order (``recovery.ordered_allreduce``)."""
        return {"local_collectives": self.local_collectives, "ordered_sums": self.ordered_sums}

    def configure(self, store: dist.Store, timeout_s: float,
                  inner_backends: dict[str, str] | None = None) -> None:
        self.store = store
        self.timeout_s = timeout_s
        if inner_backends:
            self.inner_backends = dict(inner_backends)

    def groups(self) -> list[ElasticProcessGroup]:
        with self._lock:
            alive = [g for g in (ref() for ref in self._groups)
                     if g is not None and not g.closed]
            self._groups = [weakref.ref(g) for g in alive]
        return sorted(alive, key=lambda g: g.bind_key)  # one order on every member

    def create(self, opts: Any, _backend_options: Any = None) -> ElasticProcessGroup:
        """The creator torch calls for ``backend="checkpointless"`` (extended API).

        Members meet under a key made of the group's ranks and how many open groups of
        the same ranks this process already has. torch's own name counts every group
        ever made: a replacement that re-runs the script's set-up, or survivors that
        re-enter a loop which makes and destroys a group each time (Lightning's
        ``prepare_data`` barrier), would disagree on it and wait for each other forever.
        """
        ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
        same = sum(1 for g in self.groups() if g._global_ranks == ranks)
        digest = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:12]
        timeout = getattr(opts, "timeout", None)
        group = ElasticProcessGroup(
            self, opts.group_rank, opts.group_size, ranks, str(opts.group_id),
            bind_key=f"{digest}.{same}",
            timeout_s=timeout.total_seconds() if timeout is not None else None)
        with self._lock:
            self._groups.append(weakref.ref(group))
        if self.failure is not None:
            group._failure = self.failure
        elif self.gen is not None:
            # A group made mid-generation: every member makes it now. Count the ones made
            # under this key since the generation began (the same count on every member).
            with self._lock:
                nonce = self._made_in_gen[group.bind_key] = \
                    self._made_in_gen.get(group.bind_key, 0) + 1
            group._bind(self.gen, nonce)
        return group

    def make_inner(self, group: ElasticProcessGroup, gen: int, device: str,
                   kind: str, nonce: int = 0, epoch: int | None = None) -> _Inner:
        """Connect ``group``'s inner backend for ``gen`` (a collective over its ranks).

        A gloo backend stops waiting for its peers once a failure is declared (``fail``
        since ``epoch``, or ``should_abort``), with :class:`CollectiveAborted`: a peer
        that joined the generation and then died never connects, and waiting out the
        group's timeout held the whole job for it (the 60 s incidents of the CI soak)."""
        assert self.store is not None, "Controller.configure() first"
        store = dist.PrefixStore(f"{gen_prefix(gen)}/pg/{group.bind_key}.{nonce}/{device}",
                                 self.store)
        timeout_s = group.timeout_s or self.timeout_s
        epoch = self.epoch if epoch is None else epoch

        def interrupted() -> str | None:
            if self.epoch != epoch or self.should_abort():
                return self.failure or f"a generation after {gen} was declared"
            return None

        if kind == "gloo":
            try:
                gloo = AbortableGloo.create(store, group._rank, group._size, timeout_s,
                                            interrupted=interrupted)
            except StoreWaitInterrupted as exc:
                raise CollectiveAborted(f"checkpointless: {exc}") from None
            except RuntimeError as exc:
                # gloo's own connect error: a peer that had published its address died
                # before the mesh was up ("Connection closed by peer"). A failure of the
                # job's, as the same error from a collective is (works._as_failure), not
                # of the script that called init_process_group: seen under load, where
                # a peer killed just after its own set-up stopped the job as a bug.
                raise CollectiveAborted(f"checkpointless: connecting generation {gen}'s "
                                        f"process group failed: {exc}") from exc
            return _Inner(kind, gloo.backend, gloo)
        if kind == "nccl":  # pragma: no cover - needs GPUs (the GPU check runs one rank)
            backend = nccl_inner.make_backend(store, group._rank, group._size, timeout_s,
                                              fixed_algorithm=self.nccl_fixed_algorithm)
            return _Inner(kind, backend, None)
        raise ValueError(f"checkpointless: unsupported inner backend {kind!r} for {device}")

    def activate(self, gen: int) -> None:
        """Bind every group to generation ``gen`` (collective: all ranks call it)."""
        self.gen, self.failure = gen, None
        with self._lock:
            self._made_in_gen = {}
        for group in self.groups():  # sorted by bind key: the same order on every member
            group._bind(gen)
        self._reap()

    def forget_generation(self) -> None:
        """The script's groups were destroyed to run it again in a new world
        (:mod:`recovery.resize.world_resize`): groups made from now on wait unbound, completing
        their set-up collectives locally, until the runtime activates a generation, as
        in a replacement."""
        self.gen, self.failure = None, None
        with self._lock:
            self._made_in_gen = {}

    def fail(self, reason: str) -> None:
        """A failure was declared: fail pending collectives and abort the inner groups."""
        self.failure = reason
        self.epoch += 1
        for group in self.groups():
            group._fail(reason)

    def retire(self, inner: list[_Inner], works: list[Any]) -> None:
        """Abort ``inner`` and free it once ``works`` ended (at once, normally)."""
        if not inner:
            return
        for i in inner:
            i.abort()
        with self._lock:
            self._graveyard.append((inner, works))
        self._reap()

    def _reap(self) -> None:
        with self._lock:
            graves, self._graveyard = self._graveyard, []
        keep = []
        for inner, works in graves:
            if all(w.is_completed() for w in works):
                for i in inner:
                    if i.gloo is not None:
                        i.gloo.release()
                    i.backend = None
            else:
                keep.append((inner, works))
        with self._lock:
            self._graveyard.extend(keep)

    def holding(self) -> bool:
        """True while a retired inner backend still has an operation running."""
        self._reap()
        with self._lock:
            return bool(self._graveyard)

    def stuck(self) -> str:
        """What a retired generation still holds: its inner backends whose operations
        have not ended, for the line that says why a teardown waited."""
        with self._lock:
            graves = list(self._graveyard)
        parts = []
        for inner, works in graves:
            running = sum(1 for w in works if not w.is_completed())
            kinds = ", ".join(i.kind + (" aborted" if i.gloo and i.gloo.aborted else "")
                              for i in inner)
            parts.append(f"{running} of {len(works)} operation(s) running on {kinds}")
        return "; ".join(parts) or "nothing"

    def wait_released(self, wait_s: float = 5.0) -> bool:
        """Wait until every retired inner backend is freed; False if one is stuck."""
        deadline = time.monotonic() + wait_s
        while True:
            self._reap()
            with self._lock:
                if not self._graveyard:
                    return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)


_controller = Controller()
_registered = False


def controller() -> Controller:
    return _controller


def register_backend() -> None:
    """Make ``backend="checkpointless"`` known to ``torch.distributed`` (idempotent)."""
    global _registered
    if _registered or BACKEND_NAME.upper() in dist.Backend._plugins:
        _registered = True
        return
    dist.Backend.register_backend(BACKEND_NAME, _controller.create, extended_api=True,
                                  devices=["cpu", "cuda"])
    _registered = True
