"""Benchmark: what the dataloader caches remove from a CPU-bound input pipeline.

Everything is measured side by side in one run, on the same model and the same loader
settings (only the caches are switched), and printed as one JSON object on the last line
of stdout (progress goes to stderr):

* ``epoch2_nocache_s``: the second epoch with preprocessing done every time;
* ``epoch2_cache_s``: the second epoch with the epoch cache (filled during epoch 1) and
  the node cache on, as in production;
* ``epoch2_synthetic_s``: the same model fed pre-made tensors, i.e. compute only;
* ``removed_fraction`` = (nocache - cache) / (nocache - synthetic): the share of the input
  pipeline's cost that the cache removes (1.0 = as fast as synthetic data);
* ``first_batch_after_restart_{cached,uncached}_s``: a *fresh process* restarts at a
  mid-epoch step (loader state restored as from a snapshot) and times loader
  construction to first batch, once on the node whose cache is warm and once on a new
  node (empty cache, no epoch cache). Interpreter start-up and ``import torch`` are the
  same in both and are excluded;
* ``first_batch_cached_over_uncached``: their ratio;
* ``epoch1_{nocache,cache_fill}_s``: the first epoch, where the cache is being filled
  (its write cost, for the record).

Defaults: one torch intra-op thread per calling thread (``--threads 1``) for every feed:
on 2 cores, OpenMP teams in the training thread and in each prefetch thread would
otherwise oversubscribe the CPU and make every number noise.

The dataset imitates image decoding and augmentation (uint8 decode, Gaussian blur,
antialiased resize, crop, flip, colour jitter, normalisation): a few milliseconds of
torch CPU work per sample. Run ``--quick`` for a < 60 s smoke run on 2 cores.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from dataloader_cache import CachedLoader, NodeBatchCache  # noqa: E402

IMAGE = 64
RAW = 256


def log(msg: str) -> None:
    print(f"[bench_dataloader_cache] {msg}", file=sys.stderr, flush=True)


def _blur_kernel() -> torch.Tensor:
    k = torch.arange(7, dtype=torch.float32) - 3
    k = torch.exp(-(k**2) / 4)
    k = k / k.sum()
    return (k[:, None] * k[None, :]).expand(3, 1, 7, 7).contiguous()


class AugmentedImages(Dataset):
    """Synthetic 'decoded' images with a realistic, deterministic augmentation pipeline."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.raw_size = RAW
        self.image_size = IMAGE
        self._kernel = _blur_kernel()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(i)
        raw = torch.randint(0, 256, (3, RAW, RAW), generator=g, dtype=torch.uint8)  # "decode"
        x = raw.float().div_(255).unsqueeze(0)
        x = F.conv2d(x, self._kernel, padding=3, groups=3)  # blur
        x = F.interpolate(x, size=(80, 80), mode="bilinear", antialias=True)  # resize
        top, left = i % 16, (i * 7) % 16
        x = x[..., top : top + IMAGE, left : left + IMAGE]  # crop
        if i % 2:
            x = x.flip(-1)  # flip
        x = x * (0.8 + 0.4 * ((i * 37) % 100) / 100)  # brightness jitter
        x = (x - 0.45) / 0.25  # normalise
        return {"image": x[0].contiguous(), "label": i % 10}


def preprocess_cost(ds: AugmentedImages, n: int = 32) -> float:
    """Seconds per sample, measured as the loader runs it: in a worker thread, warmed up."""

    def timed() -> float:
        for i in range(4):
            ds[i]
        t = time.perf_counter()
        for i in range(n):
            ds[i]
        return (time.perf_counter() - t) / n

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(timed).result()


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batches: Any,
    on_step: Any = None,
) -> tuple[float, int]:
    """Train over ``batches``; returns (seconds, steps). The clock includes waiting for data.

    ``on_step`` runs after each optimizer step (the cached feed commits there, as the
    recovery runtime would, which also exercises the lookback-window eviction).
    """
    steps = 0
    t0 = time.perf_counter()
    for b in batches:
        loss = F.cross_entropy(model(b["image"]), b["label"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        steps += 1
        if on_step is not None:
            on_step()
    return time.perf_counter() - t0, steps


def loader_kwargs(p: dict[str, Any]) -> dict[str, Any]:
    return dict(batch_size=p["batch_size"], seed=0, prefetch=p["prefetch"], workers=p["workers"])


def run_child(spec: dict[str, Any]) -> None:
    """A restarted worker process: time loader construction to its first batch."""
    torch.set_num_threads(spec["threads"])
    ds = AugmentedImages(spec["n"])
    t0 = time.perf_counter()
    loader = CachedLoader(
        ds,
        job_id=spec["job_id"],
        enabled=True,
        epoch_cache_path=spec["epoch_cache_path"],
        **loader_kwargs(spec),
    )
    loader.load_state_dict(spec["state"])
    batch = next(iter(loader))
    dt = time.perf_counter() - t0
    stats = loader.stats()
    loader.close()
    assert batch["image"].shape == (spec["batch_size"], 3, IMAGE, IMAGE)
    print(json.dumps({"first_batch_s": dt, "stats": stats}), flush=True)


def spawn_child(spec: dict[str, Any]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
        check=True,
        capture_output=True,
        text=True,
        cwd=str(_REPO),
        timeout=120,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small run (< 60 s on 2 cores)")
    ap.add_argument("--samples", type=int, default=None, help="dataset size")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (all feeds alike)"
    )
    ap.add_argument("--workers", type=int, default=2, help="loader prefetch workers")
    ap.add_argument("--prefetch", type=int, default=4, help="batches prefetched ahead")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        run_child(json.loads(args.child))
        return

    n = args.samples or (512 if args.quick else 2048)
    repeats = 2 if args.quick else 3
    torch.set_num_threads(args.threads)
    p = {
        "n": n,
        "batch_size": 32,
        "prefetch": args.prefetch,
        "workers": args.workers,
        "threads": args.threads,
    }
    steps = n // p["batch_size"] + (n % p["batch_size"] > 0)
    job = f"bench-{os.getpid()}-{time.time_ns()}"
    scratch = tempfile.mkdtemp(prefix="bench-dataloader-cache-")  # local disk: epoch cache
    ec_path = os.path.join(scratch, "epoch-cache")
    log(f"{n} samples, {steps} steps/epoch, batch {p['batch_size']}, torch threads {p['threads']}")
    result: dict[str, Any] = {"mode": "quick" if args.quick else "full", "samples": n}
    try:
        ds = AugmentedImages(n)
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        per_sample = preprocess_cost(ds)
        result["preprocess_ms_per_sample"] = round(per_sample * 1e3, 3)
        log(f"preprocessing: {per_sample * 1e3:.2f} ms/sample")

        synthetic = [
            {
                "image": torch.randn(p["batch_size"], 3, IMAGE, IMAGE),
                "label": torch.randint(0, 10, (p["batch_size"],)),
            }
            for _ in range(steps)
        ]
        train(model, opt, synthetic[: min(5, steps)])  # warm-up

        nocache = CachedLoader(ds, enabled=False, **loader_kwargs(p))
        train(model, opt, itertools.islice(iter(nocache), 4))  # warm-up, untimed
        nocache.seek(0, 0)
        nocache1_s, _ = train(model, opt, nocache)
        cached = CachedLoader(ds, job_id=job, epoch_cache_path=ec_path, **loader_kwargs(p))
        cached.set_epoch(0)
        fill_s, _ = train(model, opt, cached, cached.mark_committed)
        log(f"epoch 1: no cache {nocache1_s:.3f}s, cache (filling it) {fill_s:.3f}s")

        # later epochs, the three feeds interleaved; the minimum of each is reported
        # (robust to other load on the machine). Every repeat is a new epoch, so the
        # cached feed reads the epoch cache and misses the node cache every time.
        syn, noc, cac = [], [], []
        state = None
        restart_step = steps // 2
        for r in range(repeats):
            epoch = 1 + r
            syn.append(train(model, opt, synthetic)[0])
            nocache.set_epoch(epoch)
            dt, nsteps = train(model, opt, nocache)
            noc.append(dt)
            assert nsteps == steps
            cached.set_epoch(epoch)
            if r == repeats - 1:
                # the last epoch is also the one a failure strikes: the committed snapshot
                # is taken at restart_step, and the steps after it are never committed
                it = iter(cached)
                t0 = time.perf_counter()
                train(model, opt, itertools.islice(it, restart_step), cached.mark_committed)
                state = cached.state_dict()  # what the committed snapshot holds
                train(model, opt, it)
                cac.append(time.perf_counter() - t0)
            else:
                cac.append(train(model, opt, cached, cached.mark_committed)[0])
            log(
                f"epoch {epoch + 1}: synthetic {syn[-1]:.3f}s, no cache {noc[-1]:.3f}s, "
                f"cache {cac[-1]:.3f}s"
            )
        syn_s, nocache_s, cache_s = min(syn), min(noc), min(cac)
        cache_stats = cached.stats()
        nocache.close()
        cached.close()
        log(f"cached loader stats: {cache_stats}")
        assert cache_stats["epoch_cache_hits"] >= n * repeats, "later epochs missed the cache"
        assert cache_stats["hits"] == 0 and cache_stats["samples_loaded"] == n

        # restart in a fresh process at the snapshot step: warm node vs new node
        spec = {**p, "state": state, "job_id": job, "epoch_cache_path": ec_path}
        cold_job = job + "-newnode"
        warm_s, cold_s = [], []
        for _ in range(1 if args.quick else 3):
            warm = spawn_child(spec)
            warm_s.append(warm["first_batch_s"])
            assert warm["stats"]["hits"] >= 1 and warm["stats"]["samples_loaded"] == 0
            cold = spawn_child({**spec, "job_id": cold_job, "epoch_cache_path": ""})
            cold_s.append(cold["first_batch_s"])
            assert cold["stats"]["hits"] == 0
            NodeBatchCache(cold_job).cleanup()  # the next cold restart starts empty too
            log(
                f"restart, first batch: warm node {warm_s[-1] * 1e3:.1f} ms, "
                f"new node {cold_s[-1] * 1e3:.1f} ms"
            )
        warm_first, cold_first = min(warm_s), min(cold_s)

        gap = nocache_s - syn_s
        result.update(
            {
                "steps_per_epoch": steps,
                "epoch1_nocache_s": round(nocache1_s, 4),
                "epoch1_cache_fill_s": round(fill_s, 4),
                "epoch2_nocache_s": round(nocache_s, 4),
                "epoch2_cache_s": round(cache_s, 4),
                "epoch2_synthetic_s": round(syn_s, 4),
                "removed_fraction": round((nocache_s - cache_s) / gap, 4) if gap > 0 else None,
                "epoch2_cache_over_nocache": round(cache_s / nocache_s, 4),
                "first_batch_after_restart_cached_s": round(warm_first, 5),
                "first_batch_after_restart_uncached_s": round(cold_first, 5),
                "first_batch_cached_over_uncached": round(warm_first / cold_first, 4),
                "repeats": repeats,
                "cached_loader_stats": cache_stats,
            }
        )
    finally:
        NodeBatchCache(job).cleanup()
        shutil.rmtree(scratch, ignore_errors=True)
    result["targets_met"] = bool(
        (result.get("removed_fraction") or 0) >= 0.9
        and result.get("first_batch_cached_over_uncached", 1) <= 0.1
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
