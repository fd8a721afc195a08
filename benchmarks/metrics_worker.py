"""The job of ``bench_metrics``: a DDP loop on the GPT of ``examples/gpt.py`` under
``checkpointless run``. Rank 0 writes its step times and how many collectives of the
owned groups each step began (the in-flight clock's count) to ``OUT``."""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from examples.gpt import CharData, TinyGPT, loss_fn, make_corpus
from recovery import Checkpointless
from recovery.process_group.inflight_clock import CLOCK


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    data = CharData(make_corpus(), 64, 8, rank, world, seed=0)
    model = DDP(TinyGPT(data.vocab_size, args.dim, 2, seq_len=64))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    cl = Checkpointless(model=model, optimizer=opt, loader=data)
    times: list[float] = []
    ops: list[int] = []

    def train_step(step: int) -> None:
        t0, n0 = time.perf_counter(), CLOCK.operations
        x, y = data.next_batch()
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        ops.append(CLOCK.operations - n0)

    cl.run(train_step, args.steps)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"step_s": times, "ops": ops, "all_ops": CLOCK.operations,
                       "steps": args.steps}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
