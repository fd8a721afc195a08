"""In-process recovery against a torchrun full restart, on the same model, in one run.

Runs the same 2-rank training job (``benchmarks/recovery_worker.py``) four ways:

1. failure-free under ``checkpointless run`` (2 nodes x 1 worker): the reference digest;
2. SIGKILL of rank 1 in step K's backward, recovered in-process with a warm spare;
3. the same without a spare (a fresh process is started);
4. the baseline: the job under plain ``torchrun`` with a synchronous DCP checkpoint
   every N steps, the whole job SIGKILLed at step K, restarted at once with torchrun,
   which resumes from the newest checkpoint and redoes the lost steps.

Every time is measured from the kill to the moment step K has completed on every
rank. The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._harness import (
    REPO,
    digests,
    emit,
    free_port,
    job_env,
    progress,
    step_done_after,
    wait_all,
)
from recovery.protocol import read_events


def run_checkpointless(out: Path, worker_args: list[str], spares: int, fault: str) -> Path:
    """Two agents (two nodes, one worker each) on this machine; returns the run dir."""
    port = free_port()
    run_dir = out / "run"
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", out.name, "--run-dir", str(run_dir), "--spares", str(spares),
              "recovery.heartbeat_timeout_s=10"]
    if fault:
        common.append(f"recovery.fault={fault}")
    script = [str(REPO / "benchmarks" / "recovery_worker.py"), "--mode", "checkpointless",
              "--out", str(out), *worker_args]
    procs = [
        subprocess.Popen([sys.executable, "-m", "launcher.cli", "run", "--node-rank", str(n),
                          *common, *script], cwd=REPO, env=job_env(), start_new_session=True,
                         stdout=subprocess.DEVNULL)
        for n in (0, 1)
    ]
    rcs = wait_all(procs, 600)
    if any(rcs):
        raise SystemExit(f"checkpointless run failed with exit codes {rcs}; see {run_dir}")
    return run_dir


def run_torchrun(out: Path, worker_args: list[str], die_at: int) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(REPO / "benchmarks" / "recovery_worker.py"), "--mode", "dcp", "--out",
           str(out), "--die-at", str(die_at), *worker_args]
    first = subprocess.Popen(cmd, cwd=REPO, env=job_env(), start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_all([first], 600)  # killed by its own rank 1 at step die_at
    again = subprocess.Popen(cmd, cwd=REPO, env=job_env(), start_new_session=True,
                             stdout=subprocess.DEVNULL)
    rcs = wait_all([again], 600)
    if any(rcs):
        raise SystemExit(f"torchrun restart failed with exit codes {rcs}")


def recovery_figures(out: Path, run_dir: Path, kill_step: int) -> dict:
    events = read_events(run_dir / "events.jsonl")
    fault = next(e for e in events if e["event"] == "fault_injected")
    recs = [e for e in events if e["event"] == "recovery"]
    done = step_done_after(out, fault["ts"], kill_step)
    newcomer = next((e for e in recs if e.get("newcomer")), recs[0])
    return {
        "seconds": done - fault["ts"],
        "steps_lost": max(0, fault["committed"] - min(e["target_step"] for e in recs)),
        "breakdown": {k: round(v, 4) for k, v in newcomer["timings"].items()},
        "survivor_breakdown": {
            k: round(v, 4) for k, v in next(
                (e for e in recs if not e.get("newcomer")), newcomer)["timings"].items()
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    args = ap.parse_args()
    q = args.quick
    width, layers = (1024, 4) if q else (2048, 4)
    steps, every, kill_step = (14, 5, 12) if q else (40, 10, 35)
    worker_args = ["--steps", str(steps), "--width", str(width), "--layers", str(layers),
                   "--ckpt-every", str(every)]
    state_bytes = 3 * 4 * layers * (width * width + width)
    tmp = Path(tempfile.mkdtemp(prefix="bench_recovery_"))
    t0 = time.perf_counter()
    try:
        progress(f"state {state_bytes / 2**20:.0f} MiB per rank; reference run")
        ref = tmp / "reference"
        run_checkpointless(ref, worker_args, spares=0, fault="")
        fault = f"1:{kill_step}:backward:sigkill"
        progress("SIGKILL rank 1, warm spare")
        warm = tmp / "warm"
        warm_run = run_checkpointless(warm, worker_args, spares=1, fault=fault)
        progress("SIGKILL rank 1, no spare (fresh process)")
        cold = tmp / "cold"
        cold_run = run_checkpointless(cold, worker_args, spares=0, fault=fault)
        progress(f"torchrun full restart from a DCP checkpoint every {every} steps")
        base = tmp / "torchrun"
        run_torchrun(base, worker_args, kill_step)
        t_kill = next(e["ts"] for e in read_events(base / "progress.jsonl")
                      if e.get("event") == "kill")
        full_restart_s = step_done_after(base, t_kill, kill_step) - t_kill
        w = recovery_figures(warm, warm_run, kill_step)
        c = recovery_figures(cold, cold_run, kill_step)
        ref_d = digests(ref)
        result = {
            "quick": q,
            "state_bytes": state_bytes,
            "kill_step": kill_step,
            "dcp_every_n_steps": every,
            "recovery_s": w["seconds"],
            "recovery_cold_s": c["seconds"],
            "full_restart_s": full_restart_s,
            "recovery_over_restart": w["seconds"] / full_restart_s,
            "recovery_cold_over_restart": c["seconds"] / full_restart_s,
            "steps_lost": max(w["steps_lost"], c["steps_lost"]),
            "bit_identical": digests(warm) == ref_d and digests(cold) == ref_d,
            "baseline_bit_identical": digests(base) == ref_d,
            "breakdown_warm_newcomer": w["breakdown"],
            "breakdown_warm_survivor": w["survivor_breakdown"],
            "breakdown_cold_newcomer": c["breakdown"],
            "wall_s": round(time.perf_counter() - t0, 1),
        }
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    emit(result)


if __name__ == "__main__":
    main()
