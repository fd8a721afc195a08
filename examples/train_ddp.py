"""A DistributedDataParallel loop as the PyTorch DDP tutorial writes it, made recoverable.

    checkpointless run --nproc-per-node 2 examples/train_ddp.py

Everything here is plain DDP (``init_process_group``, ``DistributedDataParallel``,
``destroy_process_group``); the lines marked ``# checkpointless`` are the whole
difference (3 lines: the import, the registration, the loop hand-over). Under
``checkpointless run``, ``init_process_group`` gives the runtime's own process group, so
this DDP (built once, bucketed, overlapping its all-reduce with the backward pass)
keeps working after a rank or a node is lost. See ``examples/train_fsdp2.py`` for FSDP2.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from recovery import Checkpointless  # checkpointless

try:  # run as `-m examples.train_ddp`
    from examples.gpt import CharData, TinyGPT, loss_fn, lr_lambda, make_corpus, state_digest
except ImportError:  # run as a script path: examples/ is sys.path[0]
    from gpt import CharData, TinyGPT, loss_fn, lr_lambda, make_corpus, state_digest


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="directory for final_rank<r>.json")
    args = ap.parse_args()
    torch.set_num_threads(1)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed + rank)  # each rank its own init: DDP broadcasts rank 0's

    data = CharData(make_corpus(), args.seq_len, args.batch, rank, world, seed=args.seed)
    model = DDP(TinyGPT(data.vocab_size, args.dim, args.layers, seq_len=args.seq_len))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(10, args.steps))

    cl = Checkpointless(model=model, optimizer=opt, scheduler=sched, loader=data)  # checkpointless

    def train_step(step: int) -> None:
        x, y = data.next_batch()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if rank == 0 and (step % 10 == 0 or step == args.steps):
            print(f"[rank 0] step {step:4d} loss {loss.item():.4f}", flush=True)

    cl.run(train_step, args.steps)  # checkpointless

    out = args.out or cl.env.run_dir
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"final_rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "step": cl.step, "digest": state_digest(model.module, opt),
                   "data_order": data.order_hash, "position": data.position,
                   "gen": cl.gen}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
