"""An FSDP2 loop as the PyTorch FSDP2 tutorial writes it, made recoverable.

    checkpointless run --nproc-per-node 2 examples/train_fsdp2.py

Everything here is plain FSDP2 (``init_process_group``, ``init_device_mesh``,
``fully_shard`` on each block and on the root, ``destroy_process_group``); the lines
marked ``# checkpointless`` are the whole difference (3 lines: the import, the
registration, the loop hand-over). Under ``checkpointless run`` the mesh is built on the
runtime's own process group, so the sharded model keeps working after a rank or a node
is lost: each rank's shards (parameters and Adam state, as DTensors) are snapshotted and
replicated to another node, and a replacement receives exactly its own shards.

``--mesh 2d`` shards over a 2-D mesh (replicate x shard, HSDP) when the world size is
even. On GPUs, name ``nccl`` and build the mesh on ``"cuda"`` (written, untested here).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from recovery import Checkpointless  # checkpointless

try:  # run as `-m examples.train_fsdp2`
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
    ap.add_argument("--mesh", choices=["1d", "2d"], default="1d")
    ap.add_argument("--out", default="", help="directory for final_rank<r>.json")
    args = ap.parse_args()
    torch.set_num_threads(1)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.mesh == "2d" and world % 2 == 0 and world > 2:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(args.seed)  # FSDP2 shards the same full weights on every rank

    data = CharData(make_corpus(), args.seq_len, args.batch, rank, world, seed=args.seed)
    model = TinyGPT(data.vocab_size, args.dim, args.layers, seq_len=args.seq_len)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
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
        json.dump({"rank": rank, "step": cl.step, "digest": state_digest(model, opt),
                   "data_order": data.order_hash, "position": data.position,
                   "gen": cl.gen}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
