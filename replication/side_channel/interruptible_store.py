"""A store whose blocking reads give up the moment the caller says the wait is pointless.

Gloo connects a new group through the store: each rank writes its address, then waits
for every peer's (``get`` and ``wait`` block until the key exists, up to the group's
timeout). A rank that joined a generation's rendezvous and was stopped or killed before
it wrote its address left every peer blocked there for the whole timeout (60 s of
``recovery.collective_timeout_s``, 120 s for the side channel), although its agent had
declared the failure and a newer generation was waiting for them within seconds: a new
generation cannot wake a C++ wait in the store. Seen in the CI soak, as 60 s incidents.

Through this wrapper those two calls poll ``check`` instead (a few milliseconds apart at
first, then :data:`SLOW_POLL_S`), and ask ``interrupted()`` between polls: a reason
there ends the wait at once with :class:`StoreWaitInterrupted`, which gloo's constructor
passes through unchanged (a Python exception raised in a store method keeps its type
across torch's C++ layer). Every other call goes straight to the wrapped store.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import torch.distributed as dist

from replication.errors import CheckpointlessError

FAST_POLL_S = 0.001
"""The first pause between two ``check`` calls; each next is 1.5 times longer."""
SLOW_POLL_S = 0.02
"""The longest pause: a wait that lasts seconds costs 50 requests a second at most."""


class StoreWaitInterrupted(CheckpointlessError, RuntimeError):
    """A blocking store read was abandoned because ``interrupted()`` gave a reason."""


class InterruptibleStore(dist.Store):
    """``store`` with ``get`` and ``wait`` that stop when ``interrupted()`` gives a reason.

    ``timeout_s`` bounds a ``get`` or a ``wait`` given no timeout of its own (the timeout
    the caller would have set on the store); it raises ``DistStoreError`` then, as the
    wrapped store would."""

    def __init__(self, store: dist.Store, interrupted: Callable[[], str | None],
                 timeout_s: float) -> None:
        super().__init__()
        self._store, self._interrupted, self._timeout_s = store, interrupted, timeout_s

    # -- the two blocking reads ------------------------------------------------------
    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        limit = self._timeout_s if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + limit
        delay = FAST_POLL_S
        while not self._store.check(keys):
            if (why := self._interrupted()) is not None:
                raise StoreWaitInterrupted(f"store wait for {keys} abandoned: {why}")
            if time.monotonic() > deadline:
                raise dist.DistStoreError(
                    f"wait timeout after {limit * 1000:.0f}ms, keys: {', '.join(keys)}")
            time.sleep(delay)
            delay = min(SLOW_POLL_S, delay * 1.5)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._store.get(key)

    # -- everything else, as the wrapped store does it ---------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        self._store.set(key, value)

    def add(self, key: str, amount: int) -> int:
        return self._store.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(keys)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._store.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(key)

    def num_keys(self) -> int:
        return self._store.num_keys()

    # The names torch's C++ side calls on a Python store (as EtcdStore has them).
    deleteKey = delete_key
    getNumKeys = num_keys

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout_s = timeout.total_seconds()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.wait(keys)
        return self._store.multi_get(keys)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._store.multi_set(keys, values)

    def append(self, key: str, value: str | bytes) -> None:
        self._store.append(key, value)
