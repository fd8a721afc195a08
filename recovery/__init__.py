"""Worker-side recovery: the public runtime API and what happens after a failure.

Exports are loaded lazily so that light users of this package (the recipe loader
reading ``recovery.common.config``) do not pay for importing torch.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "Checkpointless",
    "CheckpointlessError",
    "FailureDetected",
    "InjectedFault",
    "RecoveryImpossible",
    "is_replacement",
]


def is_replacement() -> bool:
    """True in a process started to replace a failed rank (its state will be restored).

    Scripts can use it to skip expensive initialisation whose result is overwritten
    anyway, e.g. build the model under ``torch.device("meta")`` and ``to_empty()`` it.
    """
    import os

    from replication.contract import ENV_REPLACEMENT

    return os.environ.get(ENV_REPLACEMENT, "0") == "1"


def __getattr__(name: str) -> Any:
    if name == "Checkpointless":
        from recovery.runtime.checkpointless import Checkpointless

        return Checkpointless
    if name == "CheckpointlessError":
        from replication.errors import CheckpointlessError

        return CheckpointlessError
    if name in ("FailureDetected", "InjectedFault", "RecoveryImpossible"):
        from recovery.common import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'recovery' has no attribute {name!r}")
