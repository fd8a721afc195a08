"""Store records written for the operator's view only (``checkpointless status``).

Nothing in the recovery protocol reads them: rank 0's outcome of each recovery, and
each agent's progress of its node. Both are sealed like every record, and writing them
never fails anything (``launcher.job_status`` reads them).
"""

from __future__ import annotations

import json
from typing import Any

import torch.distributed as dist

from recovery.generation.protocol import PREFIX, gen_prefix
from recovery.job_store import auth


def recovered_key(gen: int) -> str:
    """Sealed, by rank 0 of ``gen`` once its recovery ended: what the incident cost."""
    return f"{gen_prefix(gen)}/recovered"


def record_recovered(store: dist.Store, gen: int, **outcome: Any) -> None:
    """Best effort: the status view is a courtesy, never a reason to fail a recovery."""
    try:
        auth.put(store, recovered_key(gen), json.dumps(outcome, default=str))
    except Exception:
        pass


def node_progress_key(node: int) -> str:
    """Sealed, by agent ``node`` every few seconds: its ranks' newest step and goodput."""
    return f"{PREFIX}/agent/{node}/progress"
