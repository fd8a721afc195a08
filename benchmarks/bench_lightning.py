"""Lightning: in-process recovery against a torchrun full restart with ``ckpt_path``.

The same job (``examples/lightning_gpt.py``: a small GPT, AdamW, 2 ranks) runs three
ways, on the same terms as ``benchmarks/bench_recovery.py``:

1. failure-free with ``Trainer(strategy="checkpointless")`` under ``checkpointless run``
   (2 nodes x 1 worker): the reference digest;
2. the same with rank 1 SIGKILLed in step K's backward, recovered in-process (a warm
   spare takes rank 1; the survivor re-enters ``fit`` from its in-memory snapshot);
3. the baseline: ``strategy="ddp"`` under plain ``torchrun`` with a ``ModelCheckpoint``
   every N steps; rank 1 SIGKILLs the whole job after step K and torchrun is started
   again at once with ``fit(ckpt_path="last")``.

Times run from the kill to the moment step K has completed on every rank;
``lightning_detect_s`` runs from the kill to the survivor's ``failure_detected`` (it
sits in DDP's gradient all-reduce or Lightning's own per-batch broadcast, both on the
runtime's process group). The last stdout line is JSON;
``lightning_recovery_over_restart`` is the headline ratio.
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
from recovery.common.events import Event
from recovery.generation.protocol import read_events

SCRIPT = str(REPO / "examples" / "lightning_gpt.py")


def run_checkpointless(out: Path, args: list[str], fault: str) -> Path:
    port = free_port()
    run_dir = out / "run"
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", out.name, "--run-dir", str(run_dir), "--spares", "1",
              "recovery.heartbeat_timeout_s=20"]
    if fault:
        common.append(f"recovery.fault={fault}")
    script = [SCRIPT, "--out", str(out), "--progress", str(out / "progress.jsonl"), *args]
    procs = [subprocess.Popen([sys.executable, "-m", "launcher.cli", "run", "--node-rank",
                               str(n), *common, *script], cwd=REPO, env=job_env(),
                              start_new_session=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
             for n in (0, 1)]
    rcs = wait_all(procs, 600)
    if any(rcs):
        raise SystemExit(f"checkpointless run failed with exit codes {rcs}; see {run_dir}")
    return run_dir


def run_torchrun(out: Path, args: list[str], die_at: int, every: int) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", SCRIPT, "--strategy", "ddp", "--out", str(out), "--progress",
           str(out / "progress.jsonl"), "--ckpt-dir", str(out / "ckpt"), "--ckpt-every",
           str(every), "--resume", "last", "--die-at", str(die_at), *args]
    first = subprocess.Popen(cmd, cwd=REPO, env=job_env(), start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_all([first], 600)  # killed by its own rank 1 after step die_at
    again = subprocess.Popen(cmd, cwd=REPO, env=job_env(), start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rcs = wait_all([again], 600)
    if any(rcs):
        raise SystemExit(f"torchrun restart failed with exit codes {rcs}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    a = ap.parse_args()
    dim, layers, samples, kill_step, every = (
        (128, 2, 64, 6, 4) if a.quick else (384, 4, 256, 25, 10))  # 256 samples: 32 steps
    args = ["--epochs", "1", "--samples", str(samples), "--dim", str(dim), "--layers",
            str(layers), "--seq-len", "32", "--val-every", "0"]
    tmp = Path(tempfile.mkdtemp(prefix="bench_lightning_"))
    t0 = time.perf_counter()
    try:
        progress("reference run (strategy='checkpointless', no failure)")
        ref = tmp / "reference"
        run_checkpointless(ref, args, "")
        progress(f"SIGKILL rank 1 in step {kill_step}, recovered in-process")
        rec = tmp / "recovered"
        rec_run = run_checkpointless(rec, args, f"1:{kill_step}:backward:sigkill")
        progress(f"torchrun, strategy='ddp', ModelCheckpoint every {every} steps, restart")
        base = tmp / "torchrun"
        run_torchrun(base, args, kill_step, every)

        events = read_events(rec_run / "events.jsonl")
        fault = next(e for e in events if e["event"] == Event.FAULT_INJECTED)
        recs = [e for e in events if e["event"] == Event.RECOVERY]
        recovery_s = step_done_after(rec, fault["ts"], kill_step) - fault["ts"]
        # The survivor noticing: its first failure_detected after the kill. It was
        # blocked in DDP's all-reduce or Lightning's per-batch broadcast.
        detected = [e["ts"] for e in events if e["event"] == Event.FAILURE_DETECTED
                    and e.get("rank") != fault["rank"] and e["ts"] >= fault["ts"]]
        if not detected:
            raise SystemExit(f"the survivor never recorded failure_detected ({rec_run})")
        t_kill = next(e["ts"] for e in read_events(base / "progress.jsonl")
                      if e.get("event") == Event.KILL)
        restart_s = step_done_after(base, t_kill, kill_step) - t_kill
        newcomer = next((e for e in recs if e.get("newcomer")), recs[0])
        survivor = next((e for e in recs if not e.get("newcomer")), newcomer)
        result = {
            "quick": a.quick,
            "kill_step": kill_step,
            "ckpt_every_n_steps": every,
            "lightning_recovery_s": recovery_s,
            "lightning_full_restart_s": restart_s,
            "lightning_recovery_over_restart": recovery_s / restart_s,
            "lightning_detect_s": min(detected) - fault["ts"],
            "steps_lost": max(0, int(fault["committed"]) - min(e["target_step"] for e in recs)),
            "steps_replayed": kill_step - 1 - min(e["target_step"] for e in recs),
            "bit_identical": digests(rec) == digests(ref),
            "breakdown_newcomer": {k: round(v, 4) for k, v in newcomer["timings"].items()},
            "breakdown_survivor": {k: round(v, 4) for k, v in survivor["timings"].items()},
            "spare_used": any(e.get("spare") for e in events
                              if e["event"] == Event.REPLACEMENT_ASSIGNED),
            "wall_s": round(time.perf_counter() - t0, 1),
        }
    finally:
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    emit(result)


if __name__ == "__main__":
    main()
