"""What an agent records about its run for ``checkpointless report`` (in ``agent_start``).

The resolved recipe tells the report where the durable checkpoints are
(``persistence.path``) and how the run was configured. It goes into ``events.jsonl``,
a file people copy around and attach to bug reports, so anything that may hold a
credential is left out: ``persistence.storage_options`` (S3 keys, tokens) is reduced to
its key names. The report takes storage options from ``--storage-option`` instead.
"""

from __future__ import annotations

from typing import Any

REDACTED = "<not recorded>"


def recorded_config(cfg: Any) -> dict[str, Any]:
    """``cfg.to_dict()`` without values that may be secret."""
    data = cfg.to_dict()
    persistence = data.get("persistence")
    if isinstance(persistence, dict) and isinstance(persistence.get("storage_options"), dict):
        persistence["storage_options"] = dict.fromkeys(persistence["storage_options"], REDACTED)
    return data
