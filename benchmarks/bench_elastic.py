"""Shrinking in place against torchrun elastic restarting at the smaller size, in one run.

The same DDP job (``benchmarks/elastic_worker.py``: a DataLoader over a
DistributedSampler, 2 nodes x 1 worker, no spare node) three ways:

1. failure-free under ``checkpointless run``: the reference for the data and weights;
2. node 1 SIGKILLed (its agent and worker) at step K under ``checkpointless run``: the
   job shrinks to 1 rank (ADR 0035) and finishes;
3. the baseline: the job under ``torchrun --nnodes=1:2`` (c10d rendezvous, elastic), a
   synchronous DCP checkpoint every 10 steps, node 1's torchrun agent and worker
   SIGKILLed at step K; torchrun restarts the survivor at world size 1, which reloads the
   newest checkpoint.

Figures:

- ``shrink_over_elastic_restart``: the seconds from the kill to the first step completed
  at the smaller size, checkpointless over torchrun (target <= 0.2). Both sides at their
  defaults in full mode (checkpointless: a killed node is declared lost two heartbeat
  intervals after its agent's connections close, ``launcher/peer_link.py``, and a job
  with no spare node shrinks at once; torchrun: the rendezvous' 30 s last call for more
  nodes). ``--quick`` shortens both (a 0.5 s interval against a 3 s last call); the
  detection is also reported on its own. A partitioned node (no connection closes) would
  take the heartbeat timeout: not measured here.
- ``throughput_after_shrink_over_ideal``: samples per second at 1 rank after the shrink,
  over half the failure-free 2-rank rate (target >= 0.9).
- ``samples_lost`` and ``samples_repeated``: each step's global samples (from the newest
  generation that ran it) against the failure-free run's (both 0 expected).
- ``final_max_rel_dev``: the final weights against the failure-free run's (the shrunk
  run sums in another order: not bit-identical).

Not captured: GPUs and NCCL (CPU and gloo here), more than two nodes, a model whose
state takes long to load (the torchrun side's DCP load is small here, so its time is
mostly the rendezvous), torchrun's own loss of the data position (measured as time only).
The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from itertools import pairwise
from pathlib import Path

from benchmarks._harness import REPO, emit, free_port, job_env, progress, wait_all
from recovery.common.events import Event
from recovery.generation.protocol import read_events

KILL_STEP = 40


def _records(out: Path) -> list[dict]:
    recs = []
    for path in out.glob("progress_*.jsonl"):
        recs += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return recs


def run_checkpointless(out: Path, worker: list[str], overrides: list[str]) -> Path:
    """Two agents (two nodes, one worker each), node 0 hosting the store."""
    port, run_dir = free_port(), out / "run"
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", out.name, "--run-dir", str(run_dir), "--spares", "0", *overrides]
    script = [str(REPO / "benchmarks" / "elastic_worker.py"), "--mode", "checkpointless",
              "--out", str(out), *worker]
    procs = [subprocess.Popen([sys.executable, "-m", "launcher.cli", "run", "--node-rank",
                               str(n), *common, *script], cwd=REPO, env=job_env(),
                              start_new_session=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
             for n in (0, 1)]
    rcs = wait_all(procs, 600)
    if rcs[0] != 0:
        raise SystemExit(f"checkpointless run failed with exit codes {rcs}; see {run_dir}")
    return run_dir


def run_torchrun_elastic(out: Path, worker: list[str], last_call_s: float | None) -> None:
    """``torchrun --nnodes=1:2`` on two agents; node 1's worker kills its node."""
    port = free_port()
    conf = ["--rdzv-conf", f"last_call_timeout={last_call_s:g}"] if last_call_s else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
           "--nproc-per-node", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", out.name, "--max-restarts", "3",
           *conf, str(REPO / "benchmarks" / "elastic_worker.py"), "--mode", "dcp",
           "--out", str(out), "--die-at", str(KILL_STEP), *worker]
    node0 = subprocess.Popen(cmd, cwd=REPO, env=job_env(), start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(2.0)  # node 0 hosts the rendezvous store: it must bind the port first
    node1 = subprocess.Popen(cmd, cwd=REPO, env=job_env(), start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rcs = wait_all([node0, node1], 600)
    if rcs[0] != 0:
        raise SystemExit(f"torchrun elastic: node 0 exited with {rcs[0]}; see {out}")


def step_sets(out: Path) -> dict[int, list[int]]:
    """Each step's samples, from the newest generation that ran it."""
    by_step: dict[int, list[dict]] = defaultdict(list)
    for r in _records(out):
        if "step" in r and "mark" not in r:
            by_step[r["step"]].append(r)
    sets = {}
    for step, recs in by_step.items():
        gen = max(r.get("gen", 0) for r in recs)
        sets[step] = [i for r in recs if r.get("gen", 0) == gen for i in r["index"]]
    return sets


def step_seconds(recs: list[dict], world: int, after: float = 0.0) -> float:
    """Median seconds between consecutive steps of one process at ``world`` ranks."""
    by_proc: dict[int, list[float]] = defaultdict(list)
    for r in recs:
        if r.get("world") == world and "mark" not in r and r["ts"] > after:
            by_proc[r.get("slot", 0)].append(r["ts"])
    ts = sorted(by_proc[min(by_proc)])[2:]  # past the first steps (warm-up, replays)
    return statistics.median(b - a for a, b in pairwise(ts))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="shorter detection on both sides")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    args = ap.parse_args()
    worker = ["--epochs", "2", "--samples", "4096", "--batch", "32", "--dim", "512",
              "--layers", "4"]
    fast = ["recovery.heartbeat_timeout_s=3", "recovery.heartbeat_interval_s=0.5",
            "recovery.spare_wait_s=1"] if args.quick else []
    tmp = Path(tempfile.mkdtemp(prefix="bench_elastic_"))
    progress(f"work dir {tmp}")
    progress("checkpointless, failure-free (the reference)")
    ref = tmp / "reference"
    run_checkpointless(ref, worker, fast)
    progress(f"checkpointless, node 1 SIGKILLed at step {KILL_STEP}, no spare node")
    cl = tmp / "shrink"
    run_dir = run_checkpointless(cl, worker, [*fast, f"recovery.fault=1:{KILL_STEP}:backward:node"])
    events = read_events(run_dir / "events.jsonl")
    killed = next(e["ts"] for e in events if e["event"] == Event.FAULT_INJECTED)
    lost = min(e["ts"] for e in events if e["event"] == Event.NODE_LOST)
    shrunk = min(e["ts"] for e in events if e["event"] == Event.WORLD_SHRUNK)
    recs = _records(cl)
    first_small = min(r["ts"] for r in recs if r.get("world") == 1 and "mark" not in r)
    progress("torchrun --nnodes=1:2 + DCP, node 1 SIGKILLed at the same step")
    tr = tmp / "torchrun"
    run_torchrun_elastic(tr, [*worker, "--ckpt-every", "10"], 3.0 if args.quick else None)
    trecs = _records(tr)
    t_kill = next(r["ts"] for r in trecs if r.get("mark") == "kill")
    t_first = min(r["ts"] for r in trecs if r.get("world") == 1 and "mark" not in r
                  and r["ts"] > t_kill)

    ref_sets, got_sets = step_sets(ref), step_sets(cl)
    lost_samples = sum(len(Counter(ref_sets[s]) - Counter(got_sets.get(s, [])))
                       for s in ref_sets)
    repeated = sum(n - 1 for s in got_sets for n in Counter(got_sets[s]).values() if n > 1)
    repeated += sum(len(Counter(got_sets[s]) - Counter(ref_sets.get(s, []))) for s in got_sets)
    a = json.loads((cl / "final_slot0.json").read_text())["weights"]
    b = json.loads((ref / "final_slot0.json").read_text())["weights"]
    dev = max(abs(x - y) / max(abs(y), 1e-3) for x, y in zip(a, b, strict=True))
    t2, t1 = step_seconds(_records(ref), 2), step_seconds(recs, 1, after=first_small)
    cl_s, tr_s = first_small - killed, t_first - t_kill
    result = {
        "quick": args.quick,
        "shrink_over_elastic_restart": round(cl_s / tr_s, 4),
        "shrink_s": round(cl_s, 3),
        "shrink_detect_s": round(lost - killed, 3),
        "shrink_spare_wait_s": round(shrunk - lost, 3),
        "shrink_after_decision_s": round(first_small - shrunk, 3),
        "elastic_restart_s": round(tr_s, 3),
        "throughput_after_shrink_over_ideal": round((t2 / t1) * 2, 4),
        "step_s_at_2": round(t2, 5), "step_s_at_1": round(t1, 5),
        "samples_lost": lost_samples, "samples_repeated": repeated,
        "final_max_rel_dev": float(f"{dev:.3e}"),
    }
    if not args.keep:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    emit(result)


if __name__ == "__main__":
    main()
