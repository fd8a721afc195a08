"""Plain DeepSpeed, no runtime: resume what ``engine.save_checkpoint`` wrote under it.

Run it on a job started with ``--no-rng``: DeepSpeed restores no per-rank RNG stream
(it keeps rank 0's ``client_state`` only), nor the DataLoader workers' seeds. Started by
``torch.distributed.run`` (never ``checkpointless run``), it builds the engine
exactly as ``examples/train_deepspeed.py`` does, calls ``engine.load_checkpoint(DIR)``
(DeepSpeed follows ``latest``), skips the micro-batches of the steps the checkpoint
holds, trains to the end and writes ``plain_rank<r>.json``: each step's loss and the
final digest of the weights, this rank's optimizer state and fp32 partition.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

import deepspeed
import torch
import torch.distributed as dist
from torch import nn
from train_deepspeed import arguments, build, digest


def main() -> None:
    ap = arguments()
    ap.add_argument("--load-dir", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    engine, data, sampler, _ = build(args, world)
    path, client = engine.load_checkpoint(args.load_dir)
    assert path is not None, f"nothing loaded from {args.load_dir}"
    done, k = engine.global_steps, args.accumulate
    steps_of = len(data) // k
    first_epoch, offset = divmod(done, steps_of)
    losses: list[float] = []
    for epoch in range(first_epoch, args.epochs):
        sampler.set_epoch(epoch)
        batches = iter(data)
        if epoch == first_epoch:
            for _ in range(offset * k):  # the micro-batches the saved steps trained on
                next(batches)
        for _ in range(offset if epoch == first_epoch else 0, steps_of):
            total = 0.0
            for _ in range(k):
                x, y, _index = next(batches)
                loss = nn.functional.mse_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
                total += loss.item() / k
            losses.append(total)
    with open(os.path.join(args.out, f"plain_rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "loaded": path, "loaded_step": done, "losses": losses,
                   "digest": digest(engine), "global_steps": engine.global_steps,
                   "position": client["position"]}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
