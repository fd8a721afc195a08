"""The configuration sections the worker runtime uses, read from the launcher's JSON.

The launcher validates the recipe and passes the result to workers as JSON; this
module only rebuilds the section dataclasses (it must not import the launcher).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

from dataloader_cache.config import DataloaderCacheConfig
from recovery.config import RecoveryConfig
from replication.config import MemoryConfig, PersistenceConfig, ReplicationConfig


@dataclass
class RuntimeSettings:
    run_dir: str = ""
    replication: ReplicationConfig = field(default_factory=ReplicationConfig)
    persistence: PersistenceConfig = field(default_factory=PersistenceConfig)
    dataloader_cache: DataloaderCacheConfig = field(default_factory=DataloaderCacheConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)

    @staticmethod
    def from_json(text: str) -> RuntimeSettings:
        data = json.loads(text)
        out = RuntimeSettings(run_dir=str(data.get("run_dir", "")))
        for f in fields(RuntimeSettings):
            if f.name == "run_dir" or f.name not in data:
                continue
            cls = type(getattr(out, f.name))
            known = {x.name for x in fields(cls)}
            setattr(out, f.name, cls(**{k: v for k, v in data[f.name].items() if k in known}))
        return out
