"""One rank of the uneven-placement budget test: build a Replicator, report the verdict.

Started by ``tests/test_memory_budget.py`` as ``python -m tests.workers.budget_worker
'<json config>'``. Config keys: rank, world_size, out, port, nodes (the node of each
rank), factor, budget_states (the budget, in multiples of this rank's state size).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from replication.config import MemoryConfig, ReplicationConfig
from replication.replica_protocol.replicator import Replicator
from replication.snapshots.memory import MemoryBudgetError
from replication.training_state.layout import flatten
from replication.training_state.state import TrainingState
from tests.helpers.mp import tcp_store, write_result
from tests.helpers.training import make_model, seed_all, train_step


def main(cfg: dict) -> dict:
    rank = cfg["rank"]
    torch.set_num_threads(1)
    store = tcp_store(cfg["port"], is_master=rank == 0)
    seed_all(rank)
    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    train_step(model, opt)  # the optimizer state exists: the state's size is final
    state = TrainingState()
    state.register("model", model)
    state.register("optim", opt)
    size = flatten(state.capture()).nbytes
    nodes = cfg["nodes"]
    try:
        rep = Replicator(
            state, store=store, rank=rank, world_size=cfg["world_size"], node=nodes[rank],
            local_world_size=nodes.count(nodes[rank]),
            config=ReplicationConfig(factor=cfg["factor"], timeout_s=10),
            memory=MemoryConfig(host_budget_bytes=int(cfg["budget_states"] * size)),
        )
    except MemoryBudgetError as exc:
        return {"refused": str(exc), "state_bytes": size}
    held = len(rep.sources[rank])
    rep.close()
    return {"refused": None, "replicas_held": held, "state_bytes": size}


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    result = main(config)
    write_result(config["out"], config["rank"], result)
    sys.stdout.flush()
    os._exit(0)
