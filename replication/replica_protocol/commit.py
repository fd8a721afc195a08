"""The commit protocol: a step counts only once every copy of it exists.

Each rank acknowledges step ``s`` after it holds its own sealed snapshot of ``s`` and
has received and verified every replica it is meant to hold for ``s``. The rank whose
acknowledgement completes the count records ``s`` as the committed step in the
rendezvous store. Ranks process steps in order on one thread and wait for the count to
complete before starting the next round, so the recorded step only ever grows, and it
never runs ahead of what every copy holds: a rank that is slow or dies mid-round simply
leaves the count short.
"""

from __future__ import annotations

import datetime
import time

import torch.distributed as dist

from replication.errors import CheckpointlessError
from replication.side_channel import signing

#: The job's committed step, sealed: the one key every reader of it uses (the worker
#: runtime, the fault injector, the agent's end-of-job line). It sits under the control
#: plane's ``cl/`` prefix (``recovery.generation.protocol``) but is defined here, where it is
#: written.
COMMITTED_KEY = "cl/committed_step"


class CommitTimeout(CheckpointlessError, RuntimeError):
    """Not every rank acknowledged a step in time (a peer is slow or dead)."""


class UntrustedCommit(CheckpointlessError, RuntimeError):
    """The committed-step record does not carry a valid seal (see
    ``replication.side_channel.signing``)."""


def committed_step(store: dist.Store, key: str = COMMITTED_KEY) -> int:
    """The newest committed step recorded in ``store``, or -1 if none is.

    The record is sealed with the job key: a recovery targets this step, so a value
    written by a process without the job secret is refused (:class:`UntrustedCommit`)
    rather than trusted. The acknowledgement counters are not sealed; the worst a forger
    can do with them is stall a round or let one finish early, and recovery checks every
    copy it uses against sealed join records and checksums, so that costs availability,
    never correctness (``docs/security.md``).
    """
    if not store.check([key]):
        return -1
    raw = store.get(key)
    payload = signing.open_sealed(key, raw)
    if payload is None:
        raise UntrustedCommit(
            f"the committed-step record {key!r} is not sealed with the job's key "
            f"(value {bytes(raw)[:40]!r}): a process without the job secret wrote it"
        )
    return int(payload.decode())


class CommitLedger:
    """Acknowledgements of one generation of ranks, counted in the store."""

    def __init__(
        self,
        store: dist.Store,
        world_size: int,
        *,
        ack_prefix: str = "checkpointless/acks",
        committed_key: str = COMMITTED_KEY,
        timeout_s: float = 120.0,
    ) -> None:
        self.store = store
        self.world_size = world_size
        self.ack_prefix = ack_prefix
        self.committed_key = committed_key
        self.timeout_s = timeout_s
        self._waiter: dist.Store | None = None  # see wait_committed
        self._can_clone = True

    def ack(self, step: int) -> bool:
        """Acknowledge ``step``; returns True if this call completed the commit."""
        count = self.store.add(f"{self.ack_prefix}/{step}", 1)
        if count == self.world_size:
            self.store.set(self.committed_key, signing.seal(self.committed_key, str(step)))
            self.store.set(f"{self.ack_prefix}/{step}/done", b"1")
            return True
        return False

    def wait_committed(self, step: int, timeout_s: float | None = None) -> None:
        """Block until every rank has acknowledged ``step``.

        A c10d TCPStore client serialises its operations, so a long ``store.wait`` on
        the shared client would starve every other thread using it (the watchdog, the
        training loop) for as long as a dead peer keeps the count short. Where the store
        can :meth:`~torch.distributed.Store.clone` itself, the ledger waits on a client
        of its own, in slices: the server answers the moment the key is set, with no
        polling round trips (each one wakes the store host's thread and this one, which
        costs training on a host whose cores are all busy). Elsewhere it polls the
        shared client with short ``check`` calls.
        """
        timeout = timeout_s or self.timeout_s
        key = f"{self.ack_prefix}/{step}/done"
        deadline = time.monotonic() + timeout
        waiter = self._own_client()
        delay = 0.0005
        while True:
            left = deadline - time.monotonic()
            if waiter is not None:
                try:
                    waiter.wait([key], datetime.timedelta(seconds=max(0.001, min(left, 1.0))))
                    return
                except dist.DistStoreError:  # this slice timed out: look at the deadline
                    pass
            elif self.store.check([key]):
                return
            if time.monotonic() > deadline:
                have = self.store.add(f"{self.ack_prefix}/{step}", 0)
                raise CommitTimeout(
                    f"step {step} was acknowledged by {have}/{self.world_size} ranks within "
                    f"{timeout:.0f}s; it stays uncommitted"
                )
            if waiter is None:
                time.sleep(delay)
                delay = min(delay * 2, 0.01)

    def _own_client(self) -> dist.Store | None:
        """A second connection to the store for blocking waits (None: poll instead)."""
        if self._waiter is None and self._can_clone:
            try:
                self._waiter = self.store.clone()
            except (AttributeError, RuntimeError, NotImplementedError):
                self._can_clone = False
        return self._waiter

    def committed_step(self) -> int:
        return committed_step(self.store, self.committed_key)

    def forget(self, step: int) -> None:
        """Delete the counters of an old step so the store does not grow without bound."""
        for key in (f"{self.ack_prefix}/{step}", f"{self.ack_prefix}/{step}/done"):
            try:
                self.store.delete_key(key)
            except Exception:
                pass
