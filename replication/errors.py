"""The root of every exception this project raises: :class:`CheckpointlessError`.

A caller that wants "anything checkpointless refused or failed at" catches one type;
each subclass also keeps the builtin it always derived from (``ValueError`` for bad
input, ``RuntimeError`` for a failed operation, ``OSError`` for storage), so existing
``except ValueError`` code keeps working. Stdlib-only and at the lowest layer, so that
every package (``dataloader_cache`` included) can derive from it.
"""

from __future__ import annotations


class CheckpointlessError(Exception):
    """Something checkpointless refused (bad input) or could not do (a failure)."""
