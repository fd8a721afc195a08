"""Worker-side recovery: the public runtime API and what happens after a failure.

Exports are loaded lazily so that light users of this package (the recipe loader
reading ``recovery.config``) do not pay for importing torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Checkpointless", "FailureDetected", "InjectedFault", "RecoveryImpossible"]


def __getattr__(name: str) -> Any:
    if name == "Checkpointless":
        from recovery.runtime import Checkpointless

        return Checkpointless
    if name in ("FailureDetected", "InjectedFault", "RecoveryImpossible"):
        from recovery import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'recovery' has no attribute {name!r}")
