"""A DeepSpeed ZeRO job's in-process recovery against a restart from DeepSpeed's own
checkpoint, on the same model, side by side in one run.

The job is ``benchmarks/deepspeed_worker.py`` (ZeRO stage 2, a client Adam, 2 ranks),
run three ways:

1. failure-free under ``checkpointless run`` (2 nodes x 1 worker): the reference digest;
2. rank 1 SIGKILLed in step K's backward (during ZeRO's gradient reduction), recovered
   in-process with a warm spare;
3. the baseline a DeepSpeed user runs today: the job under plain ``torchrun`` with
   ``engine.save_checkpoint`` every N steps, the whole job SIGKILLed at step K and started
   again at once, resuming with ``engine.load_checkpoint`` and redoing the lost steps.

Each time runs from the kill to the moment step K has completed on every rank, so the
steps either side runs again are counted. ``recovery_over_restart_deepspeed`` is the
ratio. Not captured: a restart on a real cluster also waits for the scheduler to give
the job its nodes again (minutes), and re-reads the checkpoint from shared storage
rather than a local disk, so the baseline here is the fastest restart can be. The last
stdout line is JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks._harness import digests, emit, progress, step_done_after
from benchmarks.bench_recovery import JobSize, recovery_figures, run_checkpointless, run_torchrun
from recovery.common.events import Event
from recovery.generation.protocol import read_events

WORKER = "deepspeed_worker.py"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    args = ap.parse_args()
    if importlib.util.find_spec("deepspeed") is None:
        raise SystemExit("bench_recovery_deepspeed needs deepspeed (make setup installs it)")
    size = JobSize.for_mode(args.quick)
    worker_args = size.worker_args()
    kill = size.kill_step
    # parameters, Adam's two moments and ZeRO's fp32 master copy, over 2 ranks' partitions
    params = size.layers * (size.width * size.width + size.width)
    tmp = Path(tempfile.mkdtemp(prefix="bench_recovery_deepspeed_"))
    t0 = time.perf_counter()
    try:
        progress(f"ZeRO-2, {params * 4 / 2**20:.0f} MiB of fp32 parameters")
        progress("reference run")
        ref = tmp / "reference"
        run_checkpointless(ref, worker_args, spares=0, fault="", worker=WORKER)
        progress(f"SIGKILL rank 1 in step {kill}'s backward, warm spare")
        warm = tmp / "warm"
        run_dir = run_checkpointless(warm, worker_args, spares=1,
                                     fault=f"1:{kill}:backward:sigkill", worker=WORKER)
        w = recovery_figures(warm, run_dir, kill)
        progress(f"torchrun, whole job SIGKILLed at step {kill}, restarted from "
                 "engine.load_checkpoint")
        base = tmp / "restart"
        run_torchrun(base, worker_args, kill, worker=WORKER, mode="restart")
        t_kill = next(e["ts"] for e in read_events(base / "progress.jsonl")
                      if e.get("event") == Event.KILL)
        restart_s = step_done_after(base, t_kill, kill) - t_kill
        ref_d = digests(ref)
        result = {
            "quick": args.quick,
            "zero_stage": 2,
            "parameter_bytes": params * 4,
            "kill_step": kill,
            "save_checkpoint_every_n_steps": size.dcp_every,
            "recovery_s": w["seconds"],
            "deepspeed_restart_s": restart_s,
            "recovery_over_restart_deepspeed": w["seconds"] / restart_s,
            "steps_replayed": w["steps_replayed"],
            "snapshot_interval_at_kill": w["snapshot_interval_at_kill"],
            "live": w["live"], "live_refused": w["live_refused"],
            "bit_identical": digests(warm) == ref_d,
            "baseline_bit_identical": digests(base) == ref_d,
            "breakdown_warm_newcomer": w["breakdown"],
            "wall_s": round(time.perf_counter() - t0, 1),
        }
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    emit(result)


if __name__ == "__main__":
    main()
