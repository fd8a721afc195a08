"""The messages a durable writer and its helper process exchange.

The two ends talk over a socketpair wrapped in a ``multiprocessing`` ``Connection``,
which pickles what it sends. Each kind of message is one small frozen dataclass of plain
fields, named here once, so both ends dispatch on types (``match``) instead of on the
first item of a tuple, and a misspelt kind is an undefined name (ruff reports it) rather
than a tuple that no branch ever matches. Both ends unpickle these classes: keep the
module plain data, free of heavy imports.

Training process to helper: :class:`Init` (first, once), then any number of
:class:`Save`, :class:`Abort` and finally :class:`Stop` (or the socket closes).
Helper to training process: :class:`Ready` once it has imported torch and DCP, a
:class:`Result` per :class:`Save`, and :class:`Log` records at any time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Message:
    """Base of every message; ``kind()`` is how errors and logs name it."""

    @classmethod
    def kind(cls) -> str:
        return cls.__name__.lower()


# -- training process -> helper -------------------------------------------------------------
@dataclass(frozen=True)
class Init(Message):
    """The helper's settings (``dataclasses.asdict`` of a ``SaverSettings``); sent first,
    over the socket rather than argv, since they may hold storage credentials."""

    settings: dict[str, Any]


@dataclass(frozen=True)
class Save(Message):
    """Persist ``nbytes`` at ``offset`` of the shared buffer ``shm`` (a named segment, or
    the key of a memfd whose descriptor follows this message when ``has_fd``).

    ``meta`` is the snapshot's ``SnapshotMeta.to_bytes()``. ``verify``: check the bytes
    against its digests before committing (a snapshot read in place). ``progressive``:
    the training process is still staging the buffer; the helper waits on its progress
    counter. ``live``: the shared buffers still in use (the helper unmaps the others).
    """

    job: int
    meta: bytes
    shm: str | None
    has_fd: bool
    offset: int
    nbytes: int
    verify: bool
    progressive: bool
    live: list[str]


@dataclass(frozen=True)
class Abort(Message):
    """Abandon save ``job``; ``None``: abandon every save, the current one included."""

    job: int | None


@dataclass(frozen=True)
class Stop(Message):
    """Finish the save in progress, then exit."""


# -- helper -> training process -------------------------------------------------------------
@dataclass(frozen=True)
class Ready(Message):
    """The helper has imported torch and DCP and takes saves."""

    pid: int


@dataclass(frozen=True)
class Log(Message):
    """A log record of the helper, for the parent's ``checkpointless.durable`` logger."""

    level: int
    message: str


@dataclass(frozen=True)
class Result(Message):
    """The outcome of one :class:`Save`: ``SaveResult.to_json()``."""

    result: dict[str, Any]

