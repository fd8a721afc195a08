"""Exceptions of the worker-side runtime."""

from __future__ import annotations

from replication.errors import CheckpointlessError


class FailureDetected(CheckpointlessError, RuntimeError):
    """A peer or this rank failed; the runtime rolls back and recovers in-process."""

    def __init__(self, cause: str, *, local: bool = False) -> None:
        super().__init__(cause)
        self.cause = cause
        self.local = local  # raised by this rank's own code (not observed from a peer)


class CollectiveAborted(FailureDetected):
    """A collective was failed on purpose: a failure was declared somewhere in the job,
    or an inner backend's socket to a peer broke (``recovery.process_group.owned_group``).

    Each one is counted (:attr:`raised`): a framework that flattens this error into a
    message of its own (DDP's comm hook) loses its type, and
    :func:`recovery.common.causes.classify` still knows that an exception raised after a
    collective was aborted is a consequence, not this rank's bug.
    """

    raised = 0

    def __init__(self, cause: str, *, local: bool = False) -> None:
        super().__init__(cause, local=local)
        type(self).raised += 1


class RecoveryImpossible(CheckpointlessError, RuntimeError):
    """Some rank's state has no surviving in-memory copy (the message says which)."""


class ScriptLoopError(RecoveryImpossible):
    """The script's loop is written in a way the runtime cannot protect (a DeepSpeed step
    that ends inside its gradient accumulation): the script's own error, which a replay
    or a new run repeats, so the job ends with the script-error status."""


class InjectedFault(CheckpointlessError, RuntimeError):
    """An exception raised on purpose by the fault-injection hook."""


class Fenced(CheckpointlessError, RuntimeError):
    """This process's node was declared lost and another node took its ranks over.

    The node may only have been slow (a heartbeat starved under load); its processes
    must leave without a word to the job, which already goes on without them.
    """
