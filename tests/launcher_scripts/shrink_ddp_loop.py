"""A DDP loop as the PyTorch tutorials write it, recording what each step trained on.

A ``Dataset`` whose samples carry their index, a ``DistributedSampler`` with a shuffle,
a ``DataLoader``, ``sampler.set_epoch(epoch)``, ``for x, y, index in data``, DDP with SGD
and momentum. The only additions are the runtime's lines (the registration,
``cl.epochs``, ``cl.training_step``) and the test's record: every step appends, to a
file per launch rank (opened in append mode, as a script that may run again must), the
step, the generation, the rank and world size it ran at, and the sample indices of its
batch. The final weights go to ``final_slot<launch rank>.json``. ``--reduce runtime``
averages a plain model's gradients with ``cl.all_reduce_gradients`` instead of DDP;
``--loader cached`` wraps the DataLoader in the runtime's ``CachedLoader``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from recovery import Checkpointless
from tests.launcher_scripts.indexed_data import Indexed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--samples", type=int, default=384)
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds per step (slower steps)")
    ap.add_argument("--reduce", choices=["ddp", "runtime"], default="ddp",
                    help="DDP, or a plain model with cl.all_reduce_gradients")
    ap.add_argument("--loader", choices=["plain", "cached"], default="plain")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)

    dataset = Indexed(args.samples)
    sampler = DistributedSampler(dataset, shuffle=True, seed=3)
    data = DataLoader(dataset, batch_size=args.batch, sampler=sampler)
    if args.loader == "cached":
        from dataloader_cache import CachedLoader

        data = CachedLoader(data, directory=os.path.join(args.out, "batch-cache"))
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    if args.reduce == "ddp":
        model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    cl = Checkpointless(model=model, optimizer=opt, loader=data)

    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, f"steps_slot{cl.slot}.jsonl"), "a")  # noqa: SIM115
    for epoch in cl.epochs(args.epochs):
        sampler.set_epoch(epoch)
        for x, y, index in data:
            with cl.training_step() as step:
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                if args.reduce == "runtime":
                    cl.all_reduce_gradients(model)
                opt.step()
                log.write(json.dumps({"step": step, "gen": cl.gen, "rank": rank,
                                      "world": world, "slot": cl.slot, "epoch": epoch,
                                      "index": index.tolist()}) + "\n")
                log.flush()
                time.sleep(args.sleep)
    log.close()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    with open(os.path.join(args.out, f"final_slot{cl.slot}.json"), "w") as f:
        json.dump({"slot": cl.slot, "rank": rank, "world": world, "step": cl.step,
                   "gen": cl.gen, "weights": weights.tolist()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
