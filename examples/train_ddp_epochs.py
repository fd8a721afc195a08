"""The DDP loop of the PyTorch tutorials, epoch by epoch, with its own DataLoader.

    checkpointless run --nproc-per-node 2 examples/train_ddp_epochs.py

A ``Dataset``, a ``DistributedSampler`` with a shuffle, a ``DataLoader`` with two
workers, ``sampler.set_epoch(epoch)`` and ``for batch in data``: the loop as people
write it. The lines marked ``# checkpointless`` are the whole difference: the import,
the registration (the loader is passed as it is), ``cl.epochs`` where the plain loop has
``range``, and ``with cl.training_step():`` around the step. After a failure the loop goes on
from the newest committed step, at the batch after it, in the right epoch.

``--loader stateful`` uses torchdata's ``StatefulDataLoader`` instead, ``--loader
cached`` wraps the DataLoader in ``dataloader_cache.CachedLoader``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from recovery import Checkpointless  # checkpointless


class Regression(Dataset):
    """Generated regression samples, each carrying its own index (to check the order)."""

    def __init__(self, n: int = 512, dim: int = 16, seed: int = 0, noise: float = 0.01) -> None:
        g, self.noise = torch.Generator().manual_seed(seed), noise
        self.x = torch.randn(n, dim, generator=g)
        self.y = self.x @ torch.randn(dim, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        noise = self.noise * torch.randn(1) if self.noise else 0.0  # a draw in the worker
        return self.x[i] + noise, self.y[i], i


def build_loader(kind: str, dataset: Dataset, sampler: DistributedSampler, batch: int,
                 workers: int) -> object:
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(dataset, batch_size=batch, sampler=sampler,
                                  num_workers=workers)
    data = DataLoader(dataset, batch_size=batch, sampler=sampler, num_workers=workers)
    if kind == "cached":
        from dataloader_cache import CachedLoader

        return CachedLoader(data)
    return data


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--loader", choices=("dataloader", "stateful", "cached"),
                    default="dataloader")
    ap.add_argument("--out", default="", help="directory for final_rank<r>.json")
    args = ap.parse_args()
    torch.set_num_threads(1)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1234 + rank)

    dataset = Regression()
    sampler = DistributedSampler(dataset, shuffle=True, seed=7)
    data = build_loader(args.loader, dataset, sampler, args.batch, args.workers)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    seen: list[int] = []  # every sample index this rank trained on, in order

    cl = Checkpointless(model=model, optimizer=opt, scheduler=sched, loader=data,  # checkpointless
                        extra={"seen": _Seen(seen)})

    for epoch in cl.epochs(args.epochs):  # checkpointless (plain: range(args.epochs))
        sampler.set_epoch(epoch)
        for x, y, index in data:
            with cl.training_step():  # checkpointless
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                seen.extend(index.tolist())
        sched.step()
        if rank == 0:
            print(f"[rank 0] epoch {epoch} loss {loss.item():.4f}", flush=True)

    out = args.out or cl.env.run_dir
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"final_rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "step": cl.step, "digest": _digest(model, opt),
                   "data_order": hashlib.sha256(json.dumps(seen).encode()).hexdigest(),
                   "position": len(seen), "gen": cl.gen}, f)
    dist.destroy_process_group()


class _Seen:
    """The order check's own record (or any list of numbers the script keeps, such as
    its logged losses), registered so a rollback rolls it back too."""

    def __init__(self, seen: list, dtype: torch.dtype = torch.int64) -> None:
        self.seen, self.dtype = seen, dtype

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"seen": torch.tensor(self.seen, dtype=self.dtype)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.seen[:] = state["seen"].tolist()


def _digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode() + _bytes(t))
    for pid, st in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            h.update(f"{pid}/{k}".encode() + (_bytes(v) if isinstance(v, torch.Tensor)
                                              else repr(v).encode()))
    return h.hexdigest()


def _bytes(t: torch.Tensor) -> bytes:
    """The tensor's bytes (a 0-d one too, such as Adam's ``step``)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


if __name__ == "__main__":
    main()
