"""One rank of ``bench_allreduce``: a DDP loop as the PyTorch docs write it, timed.

    torchrun ... -m benchmarks.allreduce_worker --plain --out DIR      (no runtime)
    checkpointless run ... -m benchmarks.allreduce_worker --out DIR    (the runtime)

The model is ``examples/gpt.py``'s TinyGPT; each step is a forward, a backward (DDP's
bucketed all-reduce overlapping it), an AdamW step. ``--plain`` runs the loop itself;
otherwise :class:`recovery.Checkpointless` runs it with the job's settings (none given:
the defaults). Rank 0 writes ``<out>/<tag>.json``: every step's wall time, the bytes this
process wrote to its sockets per all-reduce of the model's gradient size after training
(``/proc/self/io``'s ``wchar``; nothing else runs then), and how many all-reduces the
runtime summed in rank order.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from examples.gpt import CharData, TinyGPT, loss_fn, make_corpus

ALLREDUCES_MEASURED = 5


def _wchar() -> int:
    with open("/proc/self/io") as f:
        return int(dict(line.split(": ") for line in f.read().splitlines())["wchar"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tag", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    data = CharData(make_corpus(), args.seq_len, 8, rank, world, seed=0)
    model = DDP(TinyGPT(data.vocab_size, args.dim, args.layers, seq_len=args.seq_len))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    times: dict[int, float] = {}

    def train_step(step: int) -> None:
        t0 = time.perf_counter()
        x, y = data.next_batch()
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times[step] = time.perf_counter() - t0

    if args.plain:
        for step in range(1, args.steps + 1):
            train_step(step)
    else:
        from recovery import Checkpointless

        Checkpointless(model=model, optimizer=opt, loader=data).run(train_step, args.steps)
    numel = sum(p.numel() for p in model.parameters())
    grads = torch.ones(numel)
    dist.all_reduce(grads)  # connections warm
    dist.barrier()
    before = _wchar()
    for _ in range(ALLREDUCES_MEASURED):
        dist.all_reduce(grads)
    per_allreduce = (_wchar() - before) / ALLREDUCES_MEASURED
    ordered = 0
    if not args.plain:
        from recovery.process_group import controller

        ordered = controller.controller().ordered_sums
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"{args.tag}.json"), "w") as f:
            json.dump({"world": world, "step_s": times, "grad_bytes": numel * 4,
                       "bytes_per_allreduce": per_allreduce, "ordered_sums": ordered}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
