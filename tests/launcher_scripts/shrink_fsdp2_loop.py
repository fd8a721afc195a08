"""An FSDP2 loop as the PyTorch tutorials write it, recording what each step trained on
and, at each step's start, a digest of the full (unsharded) parameters and Adam state.

``fully_shard`` on each block and on the root over the default 1-D mesh (``--mesh
hsdp``: replicate x shard, one replica group per node of 2), AdamW, a
``DataLoader`` over a ``DistributedSampler``, ``for x, y, index in data``. Every step
appends to a file per launch rank (append mode: a script that may run again must): the
step, the generation, the world size, the sample indices and the digests of the state the
step started from and ended with (gathered with ``full_tensor()``, a collective every
rank runs).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler

from recovery import Checkpointless
from tests.launcher_scripts.indexed_data import Indexed


def full_digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """The digest of the full parameters and optimizer state (a collective)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode() + p.full_tensor().detach().numpy().tobytes())
        for key, value in sorted(opt.state.get(p, {}).items()):
            if hasattr(value, "full_tensor"):
                value = value.full_tensor()
            h.update(key.encode() + value.detach().reshape(-1).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--samples", type=int, default=384)
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--mesh", choices=["1d", "hsdp"], default="1d",
                    help="hsdp: replicate x shard, one replica group per node of 2")
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds per step (slower steps)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)  # the same full weights on every rank, then sharded
    # rows not divisible by every world size: shards of unequal and empty sizes
    model = nn.Sequential(nn.Linear(args.dim, 13), nn.Tanh(), nn.Linear(13, 7), nn.Tanh(),
                          nn.Linear(7, 1))
    mesh = None
    if args.mesh == "hsdp" and world > 2:  # at 2 ranks (one group left): 1-D
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    dataset = Indexed(args.samples, args.dim)
    sampler = DistributedSampler(dataset, shuffle=True, seed=3)
    data = DataLoader(dataset, batch_size=args.batch, sampler=sampler)
    cl = Checkpointless(model=model, optimizer=opt, loader=data)

    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, f"steps_slot{cl.slot}.jsonl"), "a")  # noqa: SIM115
    for epoch in cl.epochs(args.epochs):
        sampler.set_epoch(epoch)
        for x, y, index in data:
            with cl.training_step() as step:
                digest = full_digest(model, opt)
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                log.write(json.dumps({"step": step, "gen": cl.gen, "rank": rank,
                                      "world": world, "slot": cl.slot, "start": digest,
                                      "end": full_digest(model, opt),
                                      "index": index.tolist()}) + "\n")
                log.flush()
                time.sleep(args.sleep)
    log.close()
    final = full_digest(model, opt)
    weights = torch.cat([p.full_tensor().detach().flatten() for p in model.parameters()])
    with open(os.path.join(args.out, f"final_slot{cl.slot}.json"), "w") as f:
        json.dump({"slot": cl.slot, "world": world, "step": cl.step, "digest": final,
                   "weights": weights.tolist()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
