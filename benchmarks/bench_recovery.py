"""In-process recovery against a torchrun full restart, on the same model, in one run.

Runs the same 2-rank training job (``benchmarks/recovery_worker.py``) four ways:

1. failure-free under ``checkpointless run`` (2 nodes x 1 worker): the reference digest;
2. SIGKILL of rank 1 in step K's backward, recovered in-process with a warm spare;
3. the same without a spare (a fresh process is started);
4. the baseline: the job under plain ``torchrun`` with a synchronous DCP checkpoint
   every N steps, the whole job SIGKILLed at step K, restarted at once with torchrun,
   which resumes from the newest checkpoint and redoes the lost steps.

Every time is measured from the kill to the moment step K has completed on every
rank, so the steps the recovery replays count (``steps_replayed``: how many completed
steps ran again; the interval is the default's, ``auto``, whose probe snapshots every 8
steps, ``snapshot_interval_at_kill``). The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

from benchmarks._harness import (
    REPO,
    digests,
    emit,
    free_port,
    job_env,
    median,
    progress,
    step_done_after,
    wait_all,
)
from recovery.common.events import Event
from recovery.generation.protocol import read_events


def run_checkpointless(out: Path, worker_args: list[str], spares: int, fault: str,
                       worker: str = "recovery_worker.py") -> Path:
    """Two agents (two nodes, one worker each) on this machine; returns the run dir.
    ``worker``: the job, in ``benchmarks/`` (``--mode checkpointless``)."""
    port = free_port()
    run_dir = out / "run"
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", out.name, "--run-dir", str(run_dir), "--spares", str(spares),
              "recovery.heartbeat_timeout_s=10"]
    if fault:
        common.append(f"recovery.fault={fault}")
    script = [str(REPO / "benchmarks" / worker), "--mode", "checkpointless",
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


def run_torchrun(out: Path, worker_args: list[str], die_at: int,
                 worker: str = "recovery_worker.py", mode: str = "dcp") -> None:
    """The baseline: ``worker --mode mode`` under plain torchrun, the whole job killed by
    its rank 1 at step ``die_at`` and started again at once (it resumes its checkpoint)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(REPO / "benchmarks" / worker), "--mode", mode, "--out",
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
    fault = next(e for e in events if e["event"] == Event.FAULT_INJECTED)
    recs = [e for e in events if e["event"] == Event.RECOVERY]
    done = step_done_after(out, fault["ts"], kill_step)
    newcomer = next((e for e in recs if e.get("newcomer")), recs[0])
    target = min(e["target_step"] for e in recs)
    snaps = sorted({int(e["step"]) for e in events if e["event"] == Event.STEP
                    and e.get("stall_s") is not None and e["ts"] < fault["ts"]})
    return {
        "seconds": done - fault["ts"],
        "steps_lost": max(0, fault["committed"] - target),
        # completed steps run again: the default interval (auto) decides how many
        "steps_replayed": kill_step - 1 - target,
        "snapshot_interval_at_kill": (snaps[-1] - snaps[-2]) if len(snaps) > 1 else None,
        # a sharded job's live rollback (ADR 0049): the newcomer's own optimizer steps
        "optimizer_steps_replayed": (newcomer.get("transfer_parts") or {}).get(
            "optimizer_steps_replayed", 0),
        "live": bool(newcomer.get("live")), "live_refused": newcomer.get("live_refused", ""),
        "breakdown": {k: round(v, 4) for k, v in newcomer["timings"].items()},
        "survivor_breakdown": {
            k: round(v, 4) for k, v in next(
                (e for e in recs if not e.get("newcomer")), newcomer)["timings"].items()
        },
    }


def step_times(out: Path, rank: int) -> list[float]:
    """When rank ``rank`` completed each of its steps (replayed ones included), in order."""
    return sorted(e["ts"] for e in read_events(out / "progress.jsonl")
                  if e["rank"] == rank and "event" not in e)


def step_intervals(out: Path, rank: int, t_kill: float, n: int) -> tuple[list[float], list[float]]:
    """Rank ``rank``'s step times: the ``n`` steps completed before ``t_kill``, and the
    ``n`` after the first step completed once the recovery ended (the interval that
    spans the recovery itself is in neither)."""
    ts = step_times(out, rank)
    before = [b - a for a, b in pairwise(ts) if b < t_kill]
    after = [b - a for a, b in pairwise([t for t in ts if t > t_kill][1:])]
    if len(before) < n or len(after) < n:
        raise SystemExit(f"too few steps around the kill: {len(before)} before, "
                         f"{len(after)} after, {n} wanted ({out})")
    return before[-n:], after[:n]


def measure_wrap(tmp: Path, wrap: str, worker_args: list[str], kill_step: int,
                 cold: bool = False) -> dict:
    """Reference, warm-spare kill (and a cold one), and torchrun + DCP, for one way of
    parallelising the model (``manual``, ``ddp``, ``fsdp2`` or ``tp``: the latter in
    ``bench_recovery_model_parallel``)."""
    args = [*worker_args, "--wrap", wrap]
    fault = f"1:{kill_step}:backward:sigkill"
    progress(f"[{wrap}] reference run")
    ref = tmp / f"{wrap}_reference"
    run_checkpointless(ref, args, spares=0, fault="")
    progress(f"[{wrap}] SIGKILL rank 1 in step {kill_step}'s backward, warm spare")
    warm = tmp / f"{wrap}_warm"
    w = recovery_figures(warm, run_checkpointless(warm, args, spares=1, fault=fault), kill_step)
    runs = [warm]
    if cold:
        progress(f"[{wrap}] SIGKILL rank 1, no spare (fresh process)")
        cold_dir = tmp / f"{wrap}_cold"
        c = recovery_figures(cold_dir, run_checkpointless(cold_dir, args, spares=0, fault=fault),
                             kill_step)
        runs.append(cold_dir)
    progress(f"[{wrap}] torchrun, whole job SIGKILLed at step {kill_step}, restarted from DCP")
    base = tmp / f"{wrap}_torchrun"
    run_torchrun(base, args, kill_step)
    t_kill = next(e["ts"] for e in read_events(base / "progress.jsonl")
                  if e.get("event") == Event.KILL)
    full_restart_s = step_done_after(base, t_kill, kill_step) - t_kill
    ref_d = digests(ref)
    ref_steps = [b - a for a, b in pairwise(step_times(ref, 0))]
    fig = {"recovery_s": w["seconds"], "full_restart_s": full_restart_s,
           "recovery_over_restart": w["seconds"] / full_restart_s,
           "steps_lost": w["steps_lost"],
           "steps_replayed": w["steps_replayed"],
           "snapshot_interval_at_kill": w["snapshot_interval_at_kill"],
           "optimizer_steps_replayed": w["optimizer_steps_replayed"],
           "live": w["live"], "live_refused": w["live_refused"],
           "bit_identical": all(digests(r) == ref_d for r in runs),
           "baseline_bit_identical": digests(base) == ref_d,
           "breakdown_warm_newcomer": w["breakdown"],
           "breakdown_warm_survivor": w["survivor_breakdown"],
           "reference_step_s": median(ref_steps[1:])}
    if cold:
        fig.update(recovery_cold_s=c["seconds"],
                   recovery_cold_over_restart=c["seconds"] / full_restart_s,
                   steps_lost=max(w["steps_lost"], c["steps_lost"]),
                   steps_replayed_cold=c["steps_replayed"],
                   breakdown_cold_newcomer=c["breakdown"])
    return fig


def measure_steady_after_recovery(tmp: Path, worker_args: list[str], kill_step: int,
                                  n: int) -> dict:
    """A DDP job with a worker SIGKILLed mid-run: the survivor's median step time in the
    ``n`` steps after the recovery over the ``n`` before (abandoned gloo threads spinning
    in a survivor made it about 4 before ADR 0015)."""
    progress(f"[ddp] {n} steps, SIGKILL rank 1 at step {kill_step}, {n} more steps")
    out = tmp / "steady"
    run_dir = run_checkpointless(out, [*worker_args, "--wrap", "ddp"], spares=1,
                                 fault=f"1:{kill_step}:backward:sigkill")
    t_kill = next(e["ts"] for e in read_events(run_dir / "events.jsonl")
                  if e["event"] == Event.FAULT_INJECTED)
    before, after = step_intervals(out, 0, t_kill, n)
    return {"step_time_before_s": median(before), "step_time_after_s": median(after),
            "step_time_after_recovery_over_before": median(after) / median(before),
            "steady_steps_each_side": n}


@dataclass(frozen=True)
class JobSize:
    """The job every recovery benchmark times (this one's and
    ``bench_recovery_model_parallel``'s), per mode."""

    width: int
    layers: int
    steps: int
    dcp_every: int
    kill_step: int

    @classmethod
    def for_mode(cls, quick: bool) -> JobSize:
        return cls(1024, 4, 14, 5, 12) if quick else cls(2048, 4, 40, 10, 35)

    def worker_args(self) -> list[str]:
        return ["--steps", str(self.steps), "--width", str(self.width),
                "--layers", str(self.layers), "--ckpt-every", str(self.dcp_every)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    args = ap.parse_args()
    q = args.quick
    size = JobSize.for_mode(q)
    width, layers, every, kill_step = size.width, size.layers, size.dcp_every, size.kill_step
    worker_args = size.worker_args()
    state_bytes = 3 * 4 * layers * (width * width + width)
    n_steady = 50
    steady_args = ["--steps", str(2 * n_steady + 12), "--width", str(width),
                   "--layers", "4", "--ckpt-every", "1000"]
    tmp = Path(tempfile.mkdtemp(prefix="bench_recovery_"))
    t0 = time.perf_counter()
    try:
        progress(f"state {state_bytes / 2**20:.0f} MiB per rank")
        manual = measure_wrap(tmp, "manual", worker_args, kill_step, cold=True)
        ddp = measure_wrap(tmp, "ddp", worker_args, kill_step)
        fsdp2 = measure_wrap(tmp, "fsdp2", worker_args, kill_step)
        steady = measure_steady_after_recovery(tmp, steady_args, n_steady + 6, n_steady)
        result = {
            "quick": q,
            "state_bytes": state_bytes,
            "kill_step": kill_step,
            "dcp_every_n_steps": every,
            **{k: v for k, v in manual.items() if k != "reference_step_s"},
            "recovery_over_restart_ddp": ddp["recovery_over_restart"],
            "recovery_over_restart_fsdp2": fsdp2["recovery_over_restart"],
            "steps_replayed_fsdp2": fsdp2["steps_replayed"],
            "ddp": ddp,
            "fsdp2": fsdp2,
            "bit_identical": all(f["bit_identical"] for f in (manual, ddp, fsdp2)),
            "ddp_step_over_manual_allreduce_step":
                ddp["reference_step_s"] / manual["reference_step_s"],
            **steady,
            "wall_s": round(time.perf_counter() - t0, 1),
        }
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    emit(result)


if __name__ == "__main__":
    main()
