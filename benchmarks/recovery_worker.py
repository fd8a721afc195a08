"""The training job of ``bench_recovery``, in two modes over the same model and data.

- ``--mode checkpointless``: under ``checkpointless run``, recovered in-process.
- ``--mode dcp``: under plain ``torchrun``; a synchronous DCP checkpoint every N steps
  and, on start, a resume from the newest one (the restart baseline).

``--wrap`` says how gradients are averaged, the same way in both modes: ``manual`` (one
flat all-reduce after the backward: ``cl.all_reduce_gradients`` under the runtime),
``ddp`` (the user's ``DistributedDataParallel``), ``fsdp2`` (``fully_shard`` on every
linear layer and on the root) or ``tp`` (no data parallelism: DTensor's
``parallelize_module`` splits each pair of linear layers column- then row-wise over the
two ranks, which read the same batch).

Both modes append ``{"rank", "step", "ts"}`` lines to ``<out>/progress.jsonl`` and
write ``final_rank<r>.json`` (a digest of model and optimizer state) at the end, so
the benchmark can time recoveries and check bit-identity across modes.
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


def build(
    width: int, layers: int, restoring: bool = False
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model. ``restoring``: its values will be overwritten (a replacement rank, or a
    resume from a checkpoint), so skip the random init (seconds for large layers) by
    building on the meta device. Both modes use it, so the comparison stays fair."""
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    with torch.device("meta" if restoring else "cpu"):
        for _ in range(layers):
            mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
        model = torch.nn.Sequential(*mods)
    if restoring:
        model = model.to_empty(device="cpu")
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def batch_for(step: int, rank: int, batch: int, width: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 7919 + rank)
    return torch.randn(batch, width, generator=g)


def wrap(model: torch.nn.Module, how: str) -> torch.nn.Module:
    """The user's data parallelism (the default process group must exist)."""
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if how == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    if how == "tp":  # tensor parallelism: linear pairs split column- then row-wise
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        linears = [i for i, m in enumerate(model) if isinstance(m, torch.nn.Linear)]
        plan = {str(i): ColwiseParallel() if k % 2 == 0 else RowwiseParallel()
                for k, i in enumerate(linears)}
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        parallelize_module(model, mesh, plan)
    return model


def data_rank(rank: int, how: str) -> int:
    """Whose batch this rank trains on: under tensor parallelism every rank reads the
    same one (the ranks split the model, not the data)."""
    return 0 if how == "tp" else rank


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's own shard (FSDP2), or the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in model.parameters():
        h.update(_local(p.detach()).numpy().tobytes())
    for st in opt.state_dict()["state"].values():
        for k in sorted(st):
            v = st[k]
            h.update(_local(v).numpy().tobytes() if isinstance(v, torch.Tensor)
                     else repr(v).encode())
    return h.hexdigest()


class Progress:
    def __init__(self, out: Path, rank: int) -> None:
        self.path, self.rank = out / "progress.jsonl", rank

    def emit(self, **fields) -> None:
        line = json.dumps({"rank": self.rank, "ts": time.time(), **fields}) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, line.encode())
        os.close(fd)


def train_step(model, opt, x, reduce, device_s: float = 0.0) -> None:
    """``device_s``: the host then waits that long, idle, as it would for a device
    running the step's kernels (``bench_overhead_sharded``'s device-like steps)."""
    opt.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    if device_s:
        time.sleep(device_s)
    reduce()
    opt.step()


def run_checkpointless(args, out: Path) -> None:
    from recovery import Checkpointless, is_replacement

    rank = int(os.environ["RANK"])
    prog = Progress(out, rank)
    prog.emit(event="script_start", cpu=time.process_time())
    if args.wrap != "manual":
        dist.init_process_group("gloo")  # the runtime's own group under checkpointless run
    model, _ = build(args.width, args.layers, restoring=is_replacement())
    model = wrap(model, args.wrap)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    prog.emit(event="model_built", cpu=time.process_time(), restoring=is_replacement())
    cl = Checkpointless(model=model, optimizer=opt)
    reduce = (lambda: cl.all_reduce_gradients(model)) if args.wrap == "manual" else (
        lambda: None)

    def step_fn(step: int) -> None:
        x = batch_for(step, data_rank(rank, args.wrap), args.batch, args.width)
        train_step(model, opt, x, reduce, args.device_ms / 1000)
        prog.emit(step=step)

    cl.run(step_fn, args.steps)
    from recovery.runtime import live_rollback

    rep = cl.replicator
    (out / f"final_rank{rank}.json").write_text(json.dumps({
        "digest": digest(model, opt), "step": cl.step,
        # what the update logs (ADR 0049) hold at the end, next to the state's size
        "log_bytes": live_rollback.log_bytes(cl),
        "state_bytes": getattr(rep, "state_bytes_of_rank", [0] * (rank + 1))[rank]}))


def run_dcp(args, out: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    prog = Progress(out, rank)
    ckpt_root = out / "dcp"
    start = 1
    done = sorted((int(p.name.split("_")[1]), p) for p in ckpt_root.glob("step_*")
                  if (p / ".metadata").exists()) if ckpt_root.exists() else []
    model, _ = build(args.width, args.layers, restoring=bool(done))
    model = wrap(model, args.wrap)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    if done:
        step0, path = done[-1]
        # Adam's state exists only after a step: take one on a dummy batch, then overwrite.
        train_step(model, opt, torch.zeros(1, args.width), lambda: None)
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd, "rng": torch.get_rng_state()}
        dcp.load(sd, checkpoint_id=str(path))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        torch.set_rng_state(sd["rng"])
        start = step0 + 1
        prog.emit(event="resumed_from", step=step0)

    def reduce() -> None:
        if args.wrap != "manual":
            return
        grads = [p.grad for p in model.parameters()]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat.div_(world)
        for g, f in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(f)

    for step in range(start, args.steps + 1):
        if step == args.die_at and rank == 1 and not done:
            prog.emit(event="kill", step=step)
            os.killpg(os.getpgid(0), signal.SIGKILL)  # the whole torchrun job
        x = batch_for(step, data_rank(rank, args.wrap), args.batch, args.width)
        train_step(model, opt, x, reduce)
        prog.emit(step=step)
        if step % args.ckpt_every == 0:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd, "rng": torch.get_rng_state()},
                     checkpoint_id=str(ckpt_root / f"step_{step}"))
    (out / f"final_rank{rank}.json").write_text(json.dumps({"digest": digest(model, opt),
                                                            "step": args.steps}))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["checkpointless", "dcp"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--die-at", type=int, default=-1)
    ap.add_argument("--wrap", choices=["manual", "ddp", "fsdp2", "tp"], default="manual")
    ap.add_argument("--device-ms", type=float, default=0.0,
                    help="an idle wait per step, as for a device's kernels")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (run_checkpointless if args.mode == "checkpointless" else run_dcp)(args, out)


if __name__ == "__main__":
    main()
