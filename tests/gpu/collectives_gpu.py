"""Collectives on CUDA tensors through the runtime's owned process group, under the launcher.

Two workers share ``cuda:0`` (NCCL refuses two ranks on one device), so CUDA tensors go
over gloo inside the runtime's group: the group must order its copies against the
producing stream, or an all-reduce reads a tensor the compute stream has not written yet.
A large tensor written by a kernel just before the collective makes a missing wait show.
Each rank writes ``collectives_rank<r>.json``; the check compares them.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist


def main() -> None:
    dev = torch.device("cuda", 0)
    dist.init_process_group(backend="cpu:gloo,cuda:gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    n = 1 << 24
    expected = float(sum(range(1, world + 1)))
    errors = []
    for trial in range(3):
        # Written by a kernel on the current stream immediately before the collective.
        x = torch.zeros(n, device=dev).add_(rank + 1).mul_(1.0)
        dist.all_reduce(x)
        if not torch.equal(x.cpu(), torch.full((n,), expected)):
            errors.append(f"sync all_reduce trial {trial}")
        y = torch.zeros(n, device=dev).add_(rank + 1)
        work = dist.all_reduce(y, async_op=True)
        work.wait()  # the result must be usable on the current stream once wait() returns
        if not torch.equal(y.cpu(), torch.full((n,), expected)):
            errors.append(f"async all_reduce trial {trial}")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 1)).to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    torch.manual_seed(1 + rank)
    for _ in range(5):
        ddp(torch.randn(32, 256, device=dev)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()
    run_dir = os.environ.get("CHECKPOINTLESS_INTERNAL_RUN_DIR", ".")
    with open(os.path.join(run_dir, f"collectives_rank{rank}.json"), "w") as f:
        json.dump({"errors": errors, "ddp_params": flat.numpy().tobytes().hex()[:4096],
                   "ddp_sum": float(flat.double().sum())}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
