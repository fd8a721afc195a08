"""``examples/train_gpt.py`` on ``cuda:0``: the workload of the GPU launcher-kill check.

Every rank shares the one card (the check machine has one GPU); gradients go through the
runtime's process group as CUDA tensors. The final digest, step and data order are
written like the CPU example's so a run with a kill can be compared with one without.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from examples.gpt import CharData, TinyGPT, loss_fn, lr_lambda, make_corpus, state_digest
from recovery import Checkpointless


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda:0", help="cpu: a plumbing run on a CPU host")
    args = ap.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    dev = torch.device(args.device)
    torch.manual_seed(args.seed)
    data = CharData(make_corpus(), 16, 4, rank, world, seed=args.seed)
    model = TinyGPT(data.vocab_size, 32, 1, seq_len=16).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(4, args.steps))
    torch.manual_seed(args.seed + 1000 + rank)  # per-rank dropout streams, CUDA included

    cl = Checkpointless(model=model, optimizer=opt, scheduler=sched, loader=data)

    losses: dict[int, float] = {}  # step -> loss, as this process last computed it

    def train_step(step: int) -> None:
        x, y = data.next_batch()
        loss = loss_fn(model(x.to(dev)), y.to(dev))
        losses[step] = loss.item()  # dropout: equal losses need the CUDA RNG restored
        loss.backward()
        cl.all_reduce_gradients(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()

    cl.run(train_step, args.steps)
    with open(os.path.join(cl.env.run_dir, f"final_rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "step": cl.step, "digest": state_digest(model, opt),
                   "data_order": data.order_hash, "position": data.position}, f)
    with open(os.path.join(cl.env.run_dir, f"losses_rank{rank}.json"), "w") as f:
        json.dump({str(k): v for k, v in sorted(losses.items())}, f)


if __name__ == "__main__":
    main()
