"""Why a generation ended: the failure causes every side of the job speaks of.

A cause is declared into the store (``recovery.generation.protocol.declare_failure``) as a JSON
object whose ``kind`` is a :class:`FailureCause`; the agent, the worker runtime, the
run report and the chaos metrics all read it. Each kind is spelled here once, with its
words (:func:`describe`), and :func:`classify` tells a worker's own exception from the
consequence of a failure elsewhere by the exception's *type*, never its message.
One kind is never declared as a failure: :data:`FailureCause.USER_ERROR` is the
``kind`` of the job's fatal record when a bug in the script stops the job
(``recovery.faults.user_errors``), so that record names its cause in the same vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Any

import torch.distributed as dist

from recovery.common.errors import FailureDetected, InjectedFault
from replication.replica_protocol.commit import CommitTimeout
from replication.side_channel.transport import TransportError, WaitAbandoned


class FailureCause(StrEnum):
    """The ``kind`` of a declared failure (a ``StrEnum``: the wire format is the string)."""

    WORKER_EXIT = "worker_exit"  # an agent saw a worker process exit (a signal, a code)
    WORKER_HUNG = "worker_hung"  # an agent saw a worker stop touching its heartbeat file
    #: An agent replaced a straggler with a warm spare (``recovery.stragglers: replace``).
    STRAGGLER = "straggler"
    NODE_LOST = "node_lost"  # an agent saw a peer agent stop heartbeating
    EXCEPTION = "exception"  # a worker's own code raised (maybe a bug: see user_errors)
    PEER_FAILURE = "peer_failure"  # a worker's collective failed because a peer did
    FAILURE_DURING_RECOVERY = "failure_during_recovery"  # a recovery was interrupted
    REPLACEMENT = "replacement"  # a replacement process joining (not a failure at all)
    #: No spare took a lost node's ranks: the job goes on without them (ADR 0035). The
    #: node loss behind it was declared, and counted, already.
    WORLD_SHRUNK = "world_shrunk"
    #: A node took retired ranks back: the job grows (ADR 0035). Not a failure.
    WORLD_GROWN = "world_grown"
    #: A bug in the user's script stopped the job (``recovery.faults.user_errors``). Only the
    #: job's fatal record carries it: such a failure is never declared nor retried.
    USER_ERROR = "user_error"


#: Causes that are consequences of another failure: a survivor's failed collective, a
#: rank whose recovery broke because another failure came. They make generations but
#: are not failures of their own; the agent declares the process or node behind them.
CONSEQUENTIAL = frozenset({
    FailureCause.PEER_FAILURE, FailureCause.FAILURE_DURING_RECOVERY, FailureCause.REPLACEMENT,
    FailureCause.WORLD_SHRUNK, FailureCause.WORLD_GROWN,
})

#: Exception types that mean "the job failed elsewhere", whatever their message: the
#: runtime's own (a collective it failed on purpose, a declared failure), the
#: replication side channel's, and torch.distributed's typed errors. Not
#: ``ReplicationError`` itself: it also wraps this rank's own problems (a snapshot torn
#: by an in-place change, a checksum mismatch); its ``__cause__`` tells which.
_PEER_ERRORS: tuple[type[BaseException], ...] = (
    FailureDetected, TransportError, WaitAbandoned, CommitTimeout, dist.DistError,
)


def classify(exc: BaseException, failure_declared: Callable[[], bool]) -> FailureCause:
    """:data:`FailureCause.EXCEPTION` if ``exc`` is this rank's own, else
    :data:`FailureCause.PEER_FAILURE`.

    Peer failures are recognised by type, anywhere in the exception's chain (a
    framework that re-raises keeps the original as ``__cause__``/``__context__``).
    Frameworks that flatten an error into a new message (DDP's comm hook turns the
    runtime's :class:`~recovery.common.errors.CollectiveAborted` into a RuntimeError
    about casting to a Tensor) lose the type, so an exception raised while a failure is
    declared in the job (``failure_declared()``) is a consequence too. An injected
    fault is always this rank's own.
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, InjectedFault):
            return FailureCause.EXCEPTION
        if isinstance(e, _PEER_ERRORS):
            return FailureCause.PEER_FAILURE
        e = e.__cause__ or e.__context__
    return FailureCause.PEER_FAILURE if failure_declared() else FailureCause.EXCEPTION


def describe(cause: Mapping[str, Any]) -> str:
    """A declared cause in words: the agent's log lines, fatal reasons and the report."""
    kind = cause.get("kind")
    rank, node = cause.get("rank"), cause.get("node")
    where = f"rank {rank}" + (f" on node {node}" if node is not None else "")
    if kind == FailureCause.NODE_LOST:
        return f"node {node} lost (ranks {cause.get('ranks')})"
    if kind == FailureCause.WORLD_SHRUNK:
        return (f"node {node} lost (ranks {cause.get('ranks')}) with no spare: the job "
                f"goes on as launch ranks {cause.get('world')}")
    if kind == FailureCause.WORLD_GROWN:
        return (f"node {node} took retired ranks {cause.get('ranks')} back: the job grows to "
                f"launch ranks {cause.get('world')}")
    if kind == FailureCause.WORKER_HUNG:
        return f"{where} hung (no heartbeat for {cause.get('silent_s')}s)"
    if kind == FailureCause.STRAGGLER:
        return (f"{where} was replaced as a straggler ({cause.get('factor')}x the job's "
                f"median step)")
    if kind == FailureCause.WORKER_EXIT:
        if cause.get("signal"):
            return f"{where} was killed by {cause['signal']}"
        return f"{where} exited with code {cause.get('exitcode')}"
    if kind == FailureCause.EXCEPTION:
        return f"{where} raised {_short(cause.get('error'))}"
    if kind == FailureCause.FAILURE_DURING_RECOVERY:
        return f"failure during recovery, seen by {where}: {_short(cause.get('error'))}"
    if kind == FailureCause.PEER_FAILURE:
        return f"{where} saw a peer fail: {_short(cause.get('error'))}"
    if kind == FailureCause.USER_ERROR:  # a fatal record: its reason is the whole story
        return f"a bug in the script stopped the job: {_short(cause.get('reason'))}"
    return f"{kind or 'unknown failure'} ({where})"


def _short(text: Any, limit: int = 120) -> str:
    s = " ".join(str(text or "").split())
    return s if len(s) <= limit else s[: limit - 3] + "..."
