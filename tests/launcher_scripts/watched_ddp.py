"""A user's DDP loop for the operator tests: metrics, stragglers, health checks.

Each rank writes ``pid_rank<r>`` in the run directory when it starts (the tests signal
that process), trains ``--steps`` steps of ``--step-sleep`` seconds at least, writes
``final_rank<r>.json`` (its state digest) and, with ``--hold FILE``, waits for FILE
before it exits, so its agent keeps serving the final figures until the test has read
them.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from examples.gpt import CharData, TinyGPT, loss_fn, make_corpus, state_digest
from recovery import Checkpointless


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--hold", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    data = CharData(make_corpus(), 16, 4, rank, world, seed=0)
    model = DDP(TinyGPT(data.vocab_size, 32, 1, seq_len=16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    cl = Checkpointless(model=model, optimizer=opt, loader=data)
    run_dir = cl.env.run_dir
    with open(os.path.join(run_dir, f"pid_rank{rank}"), "w") as f:
        f.write(str(os.getpid()))

    def train_step(step: int) -> None:
        x, y = data.next_batch()
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)

    cl.run(train_step, args.steps)
    with open(os.path.join(run_dir, f"final_rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "step": cl.step, "digest": state_digest(model.module, opt),
                   "gen": cl.gen}, f)
    while args.hold and not os.path.exists(args.hold):
        time.sleep(0.1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
