"""Gradient accumulation as language-model loops write it: several micro-batches per
optimizer step, DDP's ``no_sync()`` on all but the last.

    checkpointless run --nproc-per-node 2 examples/train_ddp_accumulate.py

Each step takes ``--accumulate`` batches from the loader with ``next()``, so the loop
counts its steps itself. ``cl.steps(n)`` is that count made recoverable (the lines
marked ``# checkpointless``): after a failure a survivor goes on at the index after the
restored step, as a replacement does, and the loader resumes at the batch after it.

``--counter`` picks how the loop counts (docs/guide/loops.md, "Gradient accumulation"):

- ``steps``: ``for i in cl.steps(n):`` (recommended);
- ``zip``: ``for micro in zip(*[iter(data)] * k):``, which ends when the data does;
- ``range``: ``for _ in range(n):``, the loop's own counter. It does not go back with a
  recovery: a survivor's counter goes on from where it was, a replacement's from 0, so
  the ranks run different numbers of steps. The runtime stops such a job with one line
  that says so, at the first sign (a ``StopIteration`` from ``next()`` inside the step,
  or a rank that finished while others train).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from train_ddp_epochs import Regression, _digest, _Seen  # the sibling example

from recovery import Checkpointless  # checkpointless


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--accumulate", type=int, default=2)
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--counter", choices=("steps", "zip", "range"), default="steps")
    ap.add_argument("--out", default="", help="directory for final_rank<r>.json")
    args = ap.parse_args()
    torch.set_num_threads(1)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1234 + rank)
    dataset = Regression(n=args.samples)
    sampler = DistributedSampler(dataset, shuffle=True, seed=7)
    data = DataLoader(dataset, batch_size=args.batch, sampler=sampler, num_workers=2)
    model = DDP(nn.Sequential(nn.Dropout(0.1), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=64)
    seen: list[int] = []  # every sample index this rank trained on, in order
    losses: list[float] = []  # the loss of every step, as the script would log it

    cl = Checkpointless(model=model, optimizer=opt, scheduler=sched, loader=data,  # checkpointless
                        extra={"seen": _Seen(seen), "losses": _Seen(losses, torch.float64)})

    def train(micro: list) -> None:
        """One optimizer step over the micro-batches: DDP syncs on the last only."""
        total = 0.0
        for j, (x, y, index) in enumerate(micro):
            with model.no_sync() if j < len(micro) - 1 else contextlib.nullcontext():
                loss = nn.functional.mse_loss(model(x), y) / len(micro)
                loss.backward()
            total += loss.item()
            seen.extend(index.tolist())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(total)

    k = args.accumulate
    n = len(data) // k  # steps in an epoch
    for epoch in cl.epochs(args.epochs):  # checkpointless
        sampler.set_epoch(epoch)
        if args.counter == "zip":  # ends when the data does
            for micro in zip(*[iter(data)] * k):
                with cl.training_step():  # checkpointless
                    train(list(micro))
            continue
        batches = iter(data)
        counted = cl.steps(n) if args.counter == "steps" else range(n)  # checkpointless
        for _ in counted:
            with cl.training_step():  # checkpointless
                train([next(batches) for _ in range(k)])

    out = args.out or cl.env.run_dir
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"final_rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "step": cl.step, "digest": _digest(model, opt),
                   "data_order": hashlib.sha256(json.dumps(seen).encode()).hexdigest(),
                   "position": len(seen), "losses": losses, "gen": cl.gen}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
