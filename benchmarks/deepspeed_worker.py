"""The training job of ``bench_recovery_deepspeed``: one DeepSpeed ZeRO job, two ways.

- ``--mode checkpointless``: under ``checkpointless run``, ``Checkpointless(engine=...)``,
  recovered in-process.
- ``--mode restart``: under plain ``torchrun``, as a DeepSpeed user runs it without the
  runtime: ``engine.save_checkpoint`` every N steps (DeepSpeed's own synchronous
  checkpoint) and, on start, ``engine.load_checkpoint`` of the newest one.

Both build the same model as ``recovery_worker`` (linear layers and GELUs, a client
``torch.optim.Adam``), with ZeRO stage ``--stage`` (2 by default), and train on the same
per-step batches. Both modes turn off DeepSpeed's shared-memory CPU all-reduce (the
runtime does so for every DeepSpeed job; without it the first run of the baseline
compiles the extension for minutes), so both use gloo for every collective.

Both append ``{"rank", "step", "ts"}`` lines to ``<out>/progress.jsonl`` and write
``final_rank<r>.json`` with a digest of the weights, this rank's optimizer state and
its fp32 master partition.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from benchmarks.recovery_worker import Progress, batch_for, build
from recovery.engines import deepspeed_engine


def config(args: argparse.Namespace, world: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": args.batch * world,
        "zero_optimization": {"stage": args.stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def engine_for(args: argparse.Namespace) -> deepspeed.DeepSpeedEngine:
    deepspeed_engine.install()  # gloo for every collective, in both modes (see above)
    deepspeed.init_distributed(dist_backend="gloo")
    model, opt = build(args.width, args.layers)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt,
                                           config=config(args, dist.get_world_size()))
    return engine


def digest(engine: deepspeed.DeepSpeedEngine) -> str:
    h = hashlib.sha256()
    for p in engine.module.parameters():
        h.update(p.detach().float().numpy().tobytes())
    inner = engine.optimizer.optimizer if engine.zero_optimization_stage() else engine.optimizer
    for st in inner.state_dict()["state"].values():
        for k in sorted(st):
            v = st[k]
            h.update(v.numpy().tobytes() if isinstance(v, torch.Tensor) else repr(v).encode())
    for t in getattr(engine.optimizer, "single_partition_of_fp32_groups", []):
        h.update(t.detach().numpy().tobytes())
    return h.hexdigest()


def step_of(engine: deepspeed.DeepSpeedEngine, x: torch.Tensor) -> None:
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()


def run_checkpointless(args: argparse.Namespace, out: Path) -> None:
    from recovery import Checkpointless

    engine = engine_for(args)
    rank = dist.get_rank()
    prog = Progress(out, rank)
    cl = Checkpointless(engine=engine)

    def train_step(step: int) -> None:
        step_of(engine, batch_for(step, rank, args.batch, args.width))
        prog.emit(step=step)

    cl.run(train_step, args.steps)
    (out / f"final_rank{rank}.json").write_text(json.dumps(
        {"digest": digest(engine), "step": cl.step, "global_steps": engine.global_steps}))


def run_restart(args: argparse.Namespace, out: Path) -> None:
    engine = engine_for(args)
    rank = dist.get_rank()
    prog = Progress(out, rank)
    ckpt = out / "ds_ckpt"
    start = 1
    if (ckpt / "latest").exists():
        path, _ = engine.load_checkpoint(str(ckpt))
        if path is None:
            raise SystemExit(f"load_checkpoint found nothing in {ckpt}")
        start = engine.global_steps + 1
        prog.emit(event="resumed_from", step=engine.global_steps)
    first_run = start == 1
    for step in range(start, args.steps + 1):
        if step == args.die_at and rank == 1 and first_run:
            prog.emit(event="kill", step=step)
            os.killpg(os.getpgid(0), signal.SIGKILL)  # the whole torchrun job
        step_of(engine, batch_for(step, rank, args.batch, args.width))
        prog.emit(step=step)
        if step % args.ckpt_every == 0:
            engine.save_checkpoint(str(ckpt), tag=f"global_step{step}")
    (out / f"final_rank{rank}.json").write_text(json.dumps(
        {"digest": digest(engine), "step": args.steps, "global_steps": engine.global_steps}))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["checkpointless", "restart"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--die-at", type=int, default=-1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (run_checkpointless if args.mode == "checkpointless" else run_restart)(args, out)


if __name__ == "__main__":
    main()
