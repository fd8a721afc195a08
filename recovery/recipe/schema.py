"""The shape of the recipe's ``checkpointless:`` block.

Each section is owned by the package that consumes it (``replication.config`` and
friends) so that lower layers never import the launcher; this module only composes
them. The section names here are the YAML keys, the env-var infixes and the
override prefixes, so renaming one is a user-visible change.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dataloader_cache.config import DataloaderCacheConfig
from recovery.common.config import RecoveryConfig
from replication.config import MemoryConfig, PersistenceConfig, ReplicationConfig

#: The YAML key that holds the whole configuration, also accepted as an override prefix.
BLOCK_KEY = "checkpointless"


@dataclass
class CheckpointlessConfig:
    """The fully resolved ``checkpointless:`` block: defaults, recipe, env and overrides."""

    run_dir: str = field(
        default="",
        metadata={"help": "where events and logs go ('' : ./runs/<job id>)"},
    )
    replication: ReplicationConfig = field(default_factory=ReplicationConfig)
    persistence: PersistenceConfig = field(default_factory=PersistenceConfig)
    dataloader_cache: DataloaderCacheConfig = field(default_factory=DataloaderCacheConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dicts (deep copies), in declaration order, ready for YAML or JSON."""
        return dataclasses.asdict(self)


#: Section name -> section dataclass, in the order they appear in the block.
SECTIONS: dict[str, type] = {
    f.name: f.default_factory  # type: ignore[misc]
    for f in dataclasses.fields(CheckpointlessConfig)
    if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)
}
