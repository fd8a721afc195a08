"""Typed configuration of the data loader cache (the recipe's ``dataloader_cache`` section).

See ``replication.config`` for the field-metadata conventions the validator reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DataloaderCacheConfig:
    """Prefetching, the node-level batch cache and the epoch cache."""

    enabled: bool = field(default=True, metadata={"help": "use the node-level batch cache"})
    prefetch: int = field(default=2, metadata={"help": "batches prefetched ahead", "min": 0})
    workers: int = field(default=1, metadata={"help": "background prefetch workers", "min": 0})
    lookback: int = field(
        default=8, metadata={"help": "batches kept behind the last committed step", "min": 0}
    )
    directory: str = field(
        default="", metadata={"help": "node cache directory ('' : /dev/shm/checkpointless-<job>)"}
    )
    size_budget_bytes: int = field(
        default=1 << 30, metadata={"help": "node cache size budget", "min": 0}
    )
    epoch_cache_path: str = field(
        default="", metadata={"help": "local directory of the epoch cache ('' disables)"}
    )
    epoch_cache_budget_bytes: int = field(
        default=8 << 30, metadata={"help": "epoch cache size budget", "min": 0}
    )
