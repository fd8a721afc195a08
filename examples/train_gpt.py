"""Train a small GPT under ``checkpointless run``, surviving rank and node failures.

    checkpointless run --nproc-per-node 2 --nnodes 2 --node-rank 0 ... examples/train_gpt.py

The recoverable part is four lines: build the runtime with the state objects, average
gradients through it, and hand it the step function. At the end every rank writes a
digest of its model and optimizer state, its step and its data order, so a run with
failures can be compared with one without.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from recovery import Checkpointless

try:  # run as `-m examples.train_gpt`
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
    ap.add_argument("--step-sleep", type=float, default=0.0, help="pad each step (demos)")
    ap.add_argument("--out", default="", help="directory for final_rank<r>.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))

    torch.manual_seed(args.seed)  # same init on every rank (data parallel)
    data = CharData(make_corpus(), args.seq_len, args.batch, rank, world, seed=args.seed)
    model = TinyGPT(data.vocab_size, args.dim, args.layers, seq_len=args.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(10, args.steps))
    torch.manual_seed(args.seed + 1000 + rank)  # per-rank dropout streams

    cl = Checkpointless(model=model, optimizer=opt, scheduler=sched, loader=data)

    def train_step(step: int) -> None:
        x, y = data.next_batch()
        loss = loss_fn(model(x), y)
        loss.backward()
        cl.all_reduce_gradients(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if args.step_sleep:
            import time

            time.sleep(args.step_sleep)
        if rank == 0 and (step % 10 == 0 or step == args.steps) and not cl.replaying(step):
            print(f"[rank 0] step {step:4d} loss {loss.item():.4f}", flush=True)

    cl.run(train_step, args.steps)
    out = args.out or cl.env.run_dir
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"final_rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "step": cl.step, "digest": state_digest(model, opt),
                   "data_order": data.order_hash, "position": data.position,
                   "gen": cl.gen}, f)


if __name__ == "__main__":
    main()
