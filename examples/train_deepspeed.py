"""A DeepSpeed ZeRO loop as its users write it, made recoverable in 4 lines.

    checkpointless run --nnodes 2 --nproc-per-node 2 examples/train_deepspeed.py --stage 2

``deepspeed.init_distributed`` and ``deepspeed.initialize`` as usual, with a client
``torch.optim.AdamW``, a cosine schedule, gradient clipping and ``--accumulate``
micro-batches per optimizer step; the lines marked ``# checkpointless`` are the runtime's:
the import, ``Checkpointless(engine=..., loader=...)``, ``cl.epochs``/``cl.steps`` and
``with cl.training_step():``. One runtime step is one optimizer step, so the step holds
the accumulation's micro-batches (each ``engine(x)``, ``engine.backward(loss)``,
``engine.step()``, as DeepSpeed's own examples write them). With ``--save-dir`` it also
calls ``engine.save_checkpoint`` every ``--save-every`` steps, as a DeepSpeed script
does; plain DeepSpeed's ``engine.load_checkpoint`` reads what it wrote.

Under ``checkpointless run``, ``init_distributed`` gives DeepSpeed the runtime's own
process group (its groups fail fast and are rebuilt after a failure); ZeRO's partitions
of the optimizer state and fp32 master weights are snapshotted and replicated to another
node like any state. See docs/guide/deepspeed.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import deepspeed
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler
from train_ddp_epochs import Regression, _bytes, _Seen  # the sibling example

from recovery import Checkpointless  # checkpointless


def config(args: argparse.Namespace, world: int) -> dict:
    """The ds_config a user would write (here as a dict; a JSON file works the same)."""
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": args.accumulate,
        "train_batch_size": args.batch * args.accumulate * world,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.stage},
        "zero_allow_untested_optimizer": True,  # the client's torch AdamW
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def digest(engine: deepspeed.DeepSpeedEngine) -> str:
    """The weights, this rank's optimizer state and its fp32 master partition."""
    h = hashlib.sha256()
    for name, t in sorted(engine.module.state_dict().items()):
        h.update(name.encode() + _bytes(t))
    zero = engine.zero_optimization_stage() > 0
    inner = engine.optimizer.optimizer if zero else engine.optimizer  # the client's AdamW
    for pid, st in sorted(inner.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            h.update(f"{pid}/{k}".encode() + _bytes(v))
    for t in getattr(engine.optimizer, "single_partition_of_fp32_groups", []):
        h.update(_bytes(t))
    return h.hexdigest()


def build(args: argparse.Namespace, world: int) -> tuple:
    """The engine, the loader, its sampler and the schedule, as the script builds them."""
    torch.manual_seed(1234)  # the same initial weights on every rank
    dataset = Regression(n=args.samples, noise=0.0 if args.no_rng else 0.01)
    sampler = DistributedSampler(dataset, shuffle=True, seed=7)
    data = DataLoader(dataset, batch_size=args.batch, sampler=sampler, num_workers=2)
    model = nn.Sequential(nn.Dropout(0.0 if args.no_rng else 0.1), nn.Linear(16, 64), nn.ReLU(),
                          nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=64)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                           config=config(args, world))
    return engine, data, sampler, sched


def arguments() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, default=2, help="ZeRO stage: 0, 1 or 2")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--accumulate", type=int, default=2)
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--out", default="", help="directory for final_rank<r>.json")
    ap.add_argument("--per-micro-batch-steps", action="store_true",
                    help="the mistake: one cl.training_step() per micro-batch (refused)")
    ap.add_argument("--save-dir", default="",
                    help="engine.save_checkpoint(DIR) every --save-every optimizer steps")
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--no-rng", action="store_true",
                    help="no dropout and no augmentation: steps that draw no random numbers "
                    "(a plain DeepSpeed resume restores no per-rank RNG stream, nor the "
                    "DataLoader workers' seeds)")
    return ap


def main() -> None:
    args = arguments().parse_args()
    torch.set_num_threads(1)

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    engine, data, sampler, sched = build(args, world)
    torch.manual_seed(99 + rank)  # dropout differs per rank, as in any data-parallel job
    seen: list[int] = []  # every sample index this rank trained on, in order
    losses: list[float] = []  # each optimizer step's loss, as the script would log it

    cl = Checkpointless(engine=engine, loader=data,  # checkpointless
                        extra={"seen": _Seen(seen), "losses": _Seen(losses, torch.float64)})

    k = args.accumulate
    if args.per_micro_batch_steps:  # stopped at the first snapshot with one line
        k, steps_of = 1, len(data)
    else:
        steps_of = len(data) // k
    for epoch in cl.epochs(args.epochs):  # checkpointless
        sampler.set_epoch(epoch)
        batches = iter(data)
        for _ in cl.steps(steps_of):  # checkpointless
            with cl.training_step():  # checkpointless
                total = 0.0
                for _ in range(k):  # DeepSpeed steps the optimizer at the k-th
                    x, y, index = next(batches)
                    loss = nn.functional.mse_loss(engine(x), y)
                    engine.backward(loss)
                    engine.step()
                    total += loss.item() / k
                    seen.extend(index.tolist())
                losses.append(total)
                if args.save_dir and engine.global_steps % args.save_every == 0:
                    # DeepSpeed's own checkpoint (under the runtime: written in the
                    # background, committed atomically)
                    engine.save_checkpoint(args.save_dir, client_state={"position": len(seen)})

    out = args.out or cl.env.run_dir
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"final_rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "step": cl.step, "digest": digest(engine),
                   "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
                   "global_samples": engine.global_samples, "lr": sched.get_last_lr(),
                   "data_order": hashlib.sha256(json.dumps(seen).encode()).hexdigest(),
                   "position": len(seen), "losses": losses, "gen": cl.gen}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
