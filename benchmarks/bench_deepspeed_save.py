"""How long ``engine.save_checkpoint`` stops a DeepSpeed loop: DeepSpeed's own writer
against the runtime's (``recovery/engines/deepspeed_saves.py``), side by side in one run.

One process, ZeRO stage 2 over gloo (world size 1), an MLP of ``--width`` and
``--layers`` with a client AdamW. The loop trains ``--steps`` optimizer steps and calls
``engine.save_checkpoint`` every ``--every``, twice: once with DeepSpeed's
``TorchCheckpointEngine`` (the loop waits for ``torch.save`` to storage), once with the
runtime's engine installed as ``Checkpointless(engine=...)`` installs it (the loop waits
for the serialization into memory; a thread writes). Both write DeepSpeed's layout to a
fresh directory on the same disk, and the runs alternate, ``--rounds`` times.

Figures: the median time one ``save_checkpoint`` call keeps the loop (``blocked_s``),
the loop's wall time with its saves (``loop_s``) and without any, and
``save_blocked_ratio`` (the runtime's blocked time over DeepSpeed's). Not captured: a
shared file system's latency (the writer's advantage grows with it), several ranks
contending for one disk, GPUs (a device-to-host copy would come first). On a 2-core
host the writer thread shares the cores with the loop, which ``loop_s`` shows.

The runtime's writer fsyncs every file and directory (a committed tag survives a power
loss); DeepSpeed's ``torch.save`` returns once the bytes are in the page cache. Saves
that come faster than the disk takes the fsynced writes make the loop wait for the
previous one (back-pressure): with ``--every 5`` in full mode (a 300 MB save every
1.7 s) it waited longer than DeepSpeed's own save. The default intervals leave the
writer time to finish, as a job's saves (minutes apart) do. The last stdout line is
JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks._harness import emit, free_port, progress


def _engine(width: int, layers: int):
    import deepspeed
    import torch
    from torch import nn

    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def _loop(engine, steps: int, every: int, save_dir: Path | None) -> tuple[float, list[float]]:
    import torch

    x = torch.randn(8, engine.module[0].in_features)
    blocked: list[float] = []
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        if save_dir is not None and engine.global_steps % every == 0:
            s = time.perf_counter()
            engine.save_checkpoint(str(save_dir))
            blocked.append(time.perf_counter() - s)
    flush = getattr(engine.checkpoint_engine, "flush", None)
    if flush is not None:
        flush()  # the loop's time includes writing its last save
    return time.perf_counter() - t0, blocked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--width", type=int, default=0)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--every", type=int, default=0,
                    help="steps between saves (default: 5 quick, 20 full: the writer "
                    "finishes a save before the next one; see --help's last paragraph)")
    ap.add_argument("--rounds", type=int, default=0)
    args = ap.parse_args()
    if importlib.util.find_spec("deepspeed") is None:
        raise SystemExit("bench_deepspeed_save needs deepspeed (make setup installs it)")
    width = args.width or (768 if args.quick else 1536)
    steps = args.steps or (20 if args.quick else 40)
    rounds = args.rounds or (2 if args.quick else 3)
    args.every = args.every or (5 if args.quick else 20)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    import torch

    from recovery.engines import deepspeed_engine, deepspeed_saves

    torch.set_num_threads(1)
    deepspeed_engine.install()  # no shared-memory comm op (nothing to compile)
    deepspeed.init_distributed(dist_backend="gloo")
    engine = _engine(width, args.layers)
    theirs = engine.checkpoint_engine
    ours = deepspeed_saves.install(engine, generation=lambda: 0, run_id="bench",
                                   emit=lambda **f: None)
    params = sum(p.numel() for p in engine.module.parameters())
    progress(f"{params / 1e6:.1f}M parameters, {steps} steps, a save every {args.every}")
    root = Path(tempfile.mkdtemp(prefix="bench_ds_save_"))
    nbytes = 0
    figures: dict[str, list[float]] = {k: [] for k in (
        "plain_loop_s", "deepspeed_loop_s", "checkpointless_loop_s", "deepspeed_blocked_s",
        "checkpointless_blocked_s")}
    try:
        _loop(engine, 3, args.every, None)  # warm-up
        for r in range(rounds):
            figures["plain_loop_s"].append(_loop(engine, steps, args.every, None)[0])
            for name, writer in (("deepspeed", theirs), ("checkpointless", ours)):
                engine.checkpoint_engine = writer
                save_dir = root / f"{name}{r}"
                loop_s, blocked = _loop(engine, steps, args.every, save_dir)
                figures[f"{name}_loop_s"].append(loop_s)
                figures[f"{name}_blocked_s"] += blocked
                tag = save_dir / (save_dir / "latest").read_text().strip()
                nbytes = sum(f.stat().st_size for f in tag.iterdir() if f.suffix == ".pt")
                shutil.rmtree(save_dir, ignore_errors=True)
            progress(f"round {r + 1}/{rounds}: " + ", ".join(
                f"{k} {v[-1]:.3f}" for k, v in figures.items()))
    finally:
        engine.checkpoint_engine = ours
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in figures.items()}
    emit({
        "parameters": params, "steps": steps, "save_every": args.every, "rounds": rounds,
        "quick": args.quick, "bytes_per_save": nbytes,
        **{k: round(v, 4) for k, v in med.items()},
        "save_blocked_ratio": round(med["checkpointless_blocked_s"]
                                    / med["deepspeed_blocked_s"], 3),
        "loop_with_saves_ratio": round(med["checkpointless_loop_s"]
                                       / med["deepspeed_loop_s"], 3),
    })


if __name__ == "__main__":
    main()
