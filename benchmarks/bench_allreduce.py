"""What bit-identity costs a DDP step at 4 and 6 ranks, side by side with plain torchrun.

    python -m benchmarks.bench_allreduce [--quick]      (last stdout line: JSON)

The same DDP loop (``benchmarks/allreduce_worker.py``: TinyGPT, dim 256, 4 layers,
sequence 64, batch 8 per rank, one torch thread per rank) runs, for each world size,
three ways one after the other (and, outside ``--quick``, the three again):

- **plain**: ``torchrun --standalone``, gloo, no runtime;
- **default**: ``checkpointless run --standalone`` with no settings: the runtime's own
  process group, snapshots at the ``auto`` interval, replicas on a peer, DDP's bucket
  layout carried with the state, gloo's own ring all-reduce (ADR 0034);
- **ordered**: the same with ``recovery.ordered_allreduce=true`` (the opt-in rank-order
  sum on its own lane).

Figures:

- ``ddp_step_default_over_plain_gloo_<N>``: mean step time (steps after the first
  :data:`WARM`, snapshot steps included) of default over plain; target <= 1.05;
- ``ddp_step_ordered_over_plain_gloo_<N>``: the opt-in's cost;
- ``allreduce_bytes_per_rank_over_ring_<N>`` (default) and ``..._ordered_<N>``: what a
  rank wrote to its sockets per all-reduce of the model's gradient size, measured after
  training (``/proc/self/io``), over a ring's 2(N-1)/N of the tensor; target <= 1.1;
  ``allreduce_bytes_per_rank_over_ring``: the largest default figure over the N measured;
- ``gather_sum_bytes_over_ring_<N>``: what the all-gather-then-add this replaced sent
  ((N-1)x the tensor), over a ring's: arithmetic, not measured;
- ``ordered_sums_default``: all-reduces summed in rank order with default settings (0);
- ``load_avg_1m``.

Not captured: more than one host (every rank shares this machine's cores and
loopback, so a step is CPU-bound and communication is cheap), NCCL, and a failure (the
recovered runs' bit-identity is tested in tests/test_ddp_layout.py, not timed here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks._harness import REPO, emit, job_env, progress, wait_all

WARM = 5
WORLDS = (4, 6)
MODES = ("plain", "default", "ordered")


def _run(mode: str, world: int, steps: int, out: Path, tag: str) -> dict:
    worker = ["-m", "benchmarks.allreduce_worker", "--steps", str(steps), "--out", str(out),
              "--tag", tag]
    if mode == "plain":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(world), *worker, "--plain"]
    else:
        settings = ["recovery.ordered_allreduce=true"] if mode == "ordered" else []
        cmd = [sys.executable, "-m", "launcher.cli", "run", "--standalone", "--nproc-per-node",
               str(world), "--run-dir", str(out / f"{tag}_run"), *settings, *worker]
    proc = subprocess.Popen(cmd, cwd=REPO, env=job_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    rcs = wait_all([proc], 900)
    if rcs[0] != 0:
        err = proc.stderr.read().decode(errors="replace")[-2000:] if proc.stderr else ""
        raise SystemExit(f"{mode} at {world} ranks exited with {rcs[0]}\n{err}")
    return json.loads((out / f"{tag}.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="20 steps, one round (< 2 min)")
    args = ap.parse_args()
    steps, rounds = (20, 1) if args.quick else (60, 2)
    result: dict = {"quick": args.quick, "steps": steps, "rounds": rounds,
                    "load_avg_1m": [os.getloadavg()[0]]}
    with tempfile.TemporaryDirectory(prefix="bench_allreduce_") as tmp:
        out = Path(tmp)
        for world in WORLDS:
            means: dict[str, list[float]] = {m: [] for m in MODES}
            last: dict[str, dict] = {}
            for r in range(rounds):
                for mode in MODES:
                    progress(f"{world} ranks, {mode}, round {r + 1}/{rounds}")
                    got = _run(mode, world, steps, out, f"{mode}_{world}_{r}")
                    times = [t for s, t in got["step_s"].items() if int(s) > WARM]
                    means[mode].append(statistics.fmean(times))
                    last[mode] = got
            plain = statistics.median(means["plain"])
            ring = 2 * (world - 1) / world * last["plain"]["grad_bytes"]
            result[f"step_s_plain_{world}"] = round(plain, 4)
            for mode in ("default", "ordered"):
                mean = statistics.median(means[mode])
                result[f"step_s_{mode}_{world}"] = round(mean, 4)
                result[f"ddp_step_{mode}_over_plain_gloo_{world}"] = round(mean / plain, 3)
            result[f"allreduce_bytes_per_rank_over_ring_{world}"] = round(
                last["default"]["bytes_per_allreduce"] / ring, 4)
            result[f"allreduce_bytes_per_rank_over_ring_ordered_{world}"] = round(
                last["ordered"]["bytes_per_allreduce"] / ring, 4)
            result[f"allreduce_bytes_per_rank_over_ring_plain_{world}"] = round(
                last["plain"]["bytes_per_allreduce"] / ring, 4)
            result[f"gather_sum_bytes_over_ring_{world}"] = round((world - 1) / (2 * (world - 1)
                                                                                / world), 3)
            result.setdefault("ordered_sums_default", 0)
            result["ordered_sums_default"] += last["default"]["ordered_sums"]
            result[f"ordered_sums_opt_in_{world}"] = last["ordered"]["ordered_sums"]
            result["grad_bytes"] = last["plain"]["grad_bytes"]
    result["allreduce_bytes_per_rank_over_ring"] = max(
        result[f"allreduce_bytes_per_rank_over_ring_{w}"] for w in WORLDS)
    result["load_avg_1m"].append(os.getloadavg()[0])
    emit(result)


if __name__ == "__main__":
    main()
