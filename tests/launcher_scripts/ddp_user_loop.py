"""A user's DDP loop (``init_process_group``, ``DistributedDataParallel`` built once, a
``dist.broadcast`` of a stop flag every step as Lightning does), plus what the owned
process group tests measure: per-step wall times, this process's thread count after
each step and its CPU time, written to ``final_rank<r>.json`` with the state digest.
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


def _thread_names() -> list[str]:
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                out.append(f.read().strip())
        except OSError:
            pass
    return out


def _bucket_layout(model: DDP) -> list[list[int]]:
    """The reducer's gradient buckets as parameter indices, from torch's own reducer."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    return [[index[id(p)] for p in bucket.parameters()]
            for bucket in model.reducer._get_zeros_like_grad_buckets()]


def _ordered_sums() -> int:
    """How many all-reduces the runtime summed in rank order instead of the backend's."""
    from recovery.process_group import controller
    return controller.controller().ordered_sums


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--bucket-cap-mb", type=float, default=None)
    ap.add_argument("--record-layouts", action="store_true",
                    help="write the bucket layout each step's all-reduce used")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)  # DDP's constructor broadcasts rank 0's weights
    data = CharData(make_corpus(), 16, 4, rank, world, seed=0)
    cap = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
    model = DDP(TinyGPT(data.vocab_size, args.dim, 1, seq_len=16), **cap)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    cl = Checkpointless(model=model, optimizer=opt, loader=data)
    times: dict[int, float] = {}
    threads: dict[int, int] = {}
    names: dict[int, list[str]] = {}
    layouts: dict[int, list[list[int]]] = {}

    def train_step(step: int) -> None:
        t0 = time.perf_counter()
        stop = torch.tensor([0], dtype=torch.int32)
        dist.broadcast(stop, 0)  # the user's own blocking collective, every step
        x, y = data.next_batch()
        loss_fn(model(x), y).backward()
        if args.record_layouts:  # the buckets this step's gradients were reduced in
            layouts[step] = _bucket_layout(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        times[step] = time.perf_counter() - t0
        threads[step] = len(os.listdir("/proc/self/task"))
        names[step] = sorted(_thread_names())

    cl.run(train_step, args.steps)
    with open(os.path.join(cl.env.run_dir, f"final_rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "step": cl.step, "digest": state_digest(model.module, opt),
                   "data_order": data.order_hash, "position": data.position, "gen": cl.gen,
                   "step_times": times, "threads": threads, "thread_names": names,
                   "cpu_s": time.process_time(), "layouts": layouts,
                   "ordered_sums": _ordered_sums()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
