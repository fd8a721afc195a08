"""What a worker learns from its launcher: identity, store address, run directory.

Under ``checkpointless run`` every value comes from the environment the agent sets
(torchrun's variables plus ``CHECKPOINTLESS_INTERNAL_*``). Run directly with
``python train.py``, the worker is a single-rank job with an in-process store, so
the same script works, without recovery, on a laptop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from replication import contract


@dataclass(frozen=True)
class WorkerEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node: int
    store_addr: str | None  # recovery.job_store.store_address, or None for a standalone process
    run_dir: str
    heartbeat_file: str | None
    job_id: str
    replacement: bool
    config_json: str | None

    @property
    def launched(self) -> bool:
        return self.store_addr is not None

    def connect_store(self) -> Any:
        """A client of the job store; an in-process store when not launched."""

        import torch.distributed as dist

        if not self.launched:
            return dist.HashStore()
        from recovery.job_store import store_address

        return store_address.connect(self.store_addr, 60.0)  # type: ignore[arg-type]

    @staticmethod
    def from_environ(environ: dict[str, str] | None = None) -> WorkerEnv:
        env = dict(os.environ if environ is None else environ)

        def num(name: str, default: int) -> int:
            try:
                return int(env.get(name, default))
            except ValueError:
                raise ValueError(
                    f"environment variable {name}={env[name]!r} is not an integer"
                ) from None

        local_world = num("LOCAL_WORLD_SIZE", 1)
        rank = num("RANK", 0)
        return WorkerEnv(
            rank=rank,
            world_size=num("WORLD_SIZE", 1),
            local_rank=num("LOCAL_RANK", 0),
            local_world_size=local_world,
            node=num(contract.ENV_NODE, num("GROUP_RANK", rank // max(1, local_world))),
            store_addr=env.get(contract.ENV_STORE) or None,
            run_dir=env.get(contract.ENV_RUN_DIR) or os.path.join("runs", "standalone"),
            heartbeat_file=env.get(contract.ENV_HEARTBEAT) or None,
            job_id=contract.job_id(env) or "standalone",
            replacement=env.get(contract.ENV_REPLACEMENT, "0") == "1",
            config_json=env.get(contract.ENV_CONFIG) or None,
        )
