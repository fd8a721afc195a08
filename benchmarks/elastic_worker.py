"""The training job of ``bench_elastic``: DDP over a DataLoader with a DistributedSampler.

- ``--mode checkpointless``: under ``checkpointless run``; a lost node with no spare
  shrinks the job (ADR 0035).
- ``--mode dcp``: under ``torchrun --nnodes=MIN:MAX`` (elastic); a synchronous DCP
  checkpoint every ``--ckpt-every`` steps; a restart, at whatever size the rendezvous
  gives, resumes from the newest one (the sampler re-splits the data over the new world,
  as a torchrun user's script would). ``--die-at S``: the process of rank 1 SIGKILLs its
  whole torchrun agent's process group at step S (a node lost).

Every process appends one JSON line per completed step to ``progress_<pid>.jsonl``:
the time, the step, the world size and the sample indices of its batch.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Indexed(Dataset):
    """Generated regression samples, each carrying its index."""

    def __init__(self, n: int, dim: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def build(dim: int, layers: int) -> nn.Module:
    torch.manual_seed(1)
    parts: list[nn.Module] = []
    for _ in range(layers):
        parts += [nn.Linear(dim, dim), nn.Tanh()]
    return nn.Sequential(*parts, nn.Linear(dim, 1))


class Progress:
    def __init__(self, out: Path) -> None:
        self.f = open(out / f"progress_{os.getpid()}.jsonl", "a")  # noqa: SIM115

    def emit(self, **fields: object) -> None:
        self.f.write(json.dumps({"ts": time.time(), **fields}) + "\n")
        self.f.flush()


def step_on(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
            y: torch.Tensor) -> None:
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


def run_checkpointless(args: argparse.Namespace, out: Path) -> None:
    from recovery import Checkpointless

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    data = Indexed(args.samples, args.dim)
    sampler = DistributedSampler(data, shuffle=True, seed=3)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler)
    model = DDP(build(args.dim, args.layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cl = Checkpointless(model=model, optimizer=opt, loader=loader)
    prog = Progress(out)
    for epoch in cl.epochs(args.epochs):
        sampler.set_epoch(epoch)
        for x, y, index in loader:
            with cl.training_step() as step:
                step_on(model, opt, x, y)
                prog.emit(step=step, gen=cl.gen, world=world, slot=cl.slot,
                          index=index.tolist())
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    (out / f"final_slot{cl.slot}.json").write_text(json.dumps(
        {"step": cl.step, "weights": weights[:: max(1, weights.numel() // 4096)].tolist()}))
    dist.destroy_process_group()


def run_dcp(args: argparse.Namespace, out: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = Indexed(args.samples, args.dim)
    sampler = DistributedSampler(data, shuffle=True, seed=3)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler)
    model = DDP(build(args.dim, args.layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    prog = Progress(out)
    root = out / "dcp"
    done = sorted((int(p.name.split("_")[1]), p) for p in root.glob("step_*")
                  if (p / ".metadata").exists()) if root.exists() else []
    step = 0
    if done:
        step, path = done[-1]
        x0 = torch.zeros(1, args.dim)  # AdamW's state exists only after a step
        step_on(model, opt, x0, torch.zeros(1, 1))
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=str(path))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        prog.emit(mark="resumed_from", step=step, world=world)
    per_epoch = len(loader)
    total = args.epochs * (args.samples // (args.batch * args.configured))
    while step < total:  # the step count of the configured world; the data re-split
        epoch, skip = divmod(step, per_epoch)
        sampler.set_epoch(epoch)
        for i, (x, y, index) in enumerate(loader):
            if i < skip:
                continue
            step += 1
            if step == args.die_at and rank == 1 and not done:
                prog.emit(mark="kill", step=step)
                # this node: its torchrun agent (which started the worker in a session
                # of its own), then the worker
                os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)
                os.killpg(os.getpgid(0), signal.SIGKILL)
            step_on(model, opt, x, y)
            prog.emit(step=step, world=world, index=index.tolist())
            if step % args.ckpt_every == 0:
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(root / f"step_{step}"))
            if step >= total:
                break
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["checkpointless", "dcp"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--configured", type=int, default=2, help="the launch world size")
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--die-at", type=int, default=-1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (run_checkpointless if args.mode == "checkpointless" else run_dcp)(args, out)


if __name__ == "__main__":
    main()
