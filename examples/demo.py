"""The main job: train a small GPT on two nodes, kill a worker and then a whole node.

    make demo        (or: python -m examples.demo [--steps N])

Two "nodes" (agents on this machine), each with two workers and one warm spare, plus
a spare node, train ``examples/train_gpt.py``. A worker is SIGKILLed mid-run and
later node 1 is lost with its agent; both failures are recovered in-process from peer
replicas. The demo prints the recovery timeline and checks that the final model and
optimizer state, the step and the data order are bit-identical to a failure-free run
of the same seed, and exits non-zero if they are not.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from launcher.local_cluster import LocalCluster
from launcher.report.model import PHASE_LABELS, PHASES, build_run
from recovery.common.events import Event
from recovery.generation.protocol import read_events

REPO = Path(__file__).resolve().parent.parent
SHOWN = {
    Event.FAULT_INJECTED: lambda e: f"fault injected on rank {e['rank']} at step {e['step']} "
    f"({e['phase']}, {e['kind']}); committed step {e.get('committed')}",
    Event.WORKER_EXIT:
    lambda e: f"rank {e['rank']} exited ({e.get('signal') or e.get('exitcode')})",
    Event.WORKER_HUNG: lambda e: f"rank {e['rank']} hung; killed",
    Event.NODE_LOST: lambda e: f"node {e.get('lost_node', e.get('lost'))} lost",
    Event.FAILURE_DECLARED: lambda e: f"generation {e['gen']} declared ({e['cause'].get('kind')})",
    Event.REPLACEMENT_ASSIGNED: lambda e: f"rank {e['rank']} handed to "
    f"{'a warm spare' if e.get('spare') else 'a new process'} (pid {e['pid']})",
    Event.NODE_TAKEOVER: lambda e: f"node {e.get('node')} took over ranks {e.get('ranks')}",
    Event.RESUMED: lambda e: f"training resumed: step {e['step']} done",
    Event.JOB_DONE: lambda e: "job done",
}


def run(tag: str, out: Path, steps: int, faults: str, spares: int, spare_nodes: int) -> Path:
    run_dir = out / tag
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = ["recovery.heartbeat_timeout_s=10", "recovery.heartbeat_interval_s=0.5"]
    if faults:
        overrides.append(f"recovery.fault={faults}")
    cluster = LocalCluster(
        command=[str(REPO / "examples" / "train_gpt.py"), "--steps", str(steps),
                 "--out", str(run_dir)],
        run_dir=run_dir, nnodes=2, nproc_per_node=2, spares=spares, spare_nodes=spare_nodes,
        overrides=overrides, job_id=f"demo-{tag}", cwd=REPO,
    )
    rcs = cluster.start().wait(timeout_s=900)
    if rcs[0] != 0:
        sys.exit(f"demo: the {tag} run failed (agent exit codes {rcs}); see {run_dir}")
    return run_dir


def finals(run_dir: Path) -> list[dict]:
    return [json.loads((run_dir / f"final_rank{r}.json").read_text()) for r in range(4)]


def print_timeline(run_dir: Path) -> None:
    events = read_events(run_dir / "events.jsonl")
    t0 = next((e["ts"] for e in events if e["event"] == Event.FAULT_INJECTED), events[0]["ts"])
    print("\nRecovery timeline (seconds from the first fault):")
    seen_recovery: set[int] = set()
    for e in events:
        fmt = SHOWN.get(e["event"])
        if fmt is None:
            continue
        if e["event"] == Event.RESUMED:  # one line per generation
            key = (e["event"], e["gen"])
            if key in seen_recovery:
                continue
            seen_recovery.add(key)  # type: ignore[arg-type]
        try:
            text = fmt(e)
        except KeyError:
            text = e["event"]
        print(f"  {e['ts'] - t0:8.3f}s  {e['source']:>7}  {text}")
    # The same model as `checkpointless report` (launcher/report/model.py): one line per
    # failure, its generations folded in, the critical rank's phases adding up to it.
    print("\nRecoveries (as `checkpointless report` counts them):")
    for f in build_run(events).recoveries:
        parts = ", ".join(f"{PHASE_LABELS[p]} {f.phases.get(p, 0.0):.3f}s" for p in PHASES)
        print(f"  generation {f.gens_text}: {'; '.join(f.what)}")
        print(f"    rolled back to step {f.target_step}, state sent to ranks {f.newcomers} "
              f"({f.bytes_transferred / 1e6:.2f} MB); {parts}; total {f.recovery_s:.3f}s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default=str(REPO / "runs" / "demo"))
    args = ap.parse_args()
    out = Path(args.out)
    kill_step, node_step = args.steps // 4, (args.steps * 2) // 3
    faults = f"1:{kill_step}:backward:sigkill;2:{node_step}:forward:node"
    t0 = time.time()
    print(f"[demo] failure-free reference: 2 nodes x 2 workers, {args.steps} steps", flush=True)
    ref = finals(run("reference", out, args.steps, "", spares=0, spare_nodes=0))
    print(f"[demo] same job with failures: SIGKILL rank 1 at step {kill_step}, lose node 1 "
          f"(agent + ranks 2, 3) at step {node_step}; 1 warm spare per node, 1 spare node",
          flush=True)
    failed_dir = run("failures", out, args.steps, faults, spares=1, spare_nodes=1)
    got = finals(failed_dir)
    print_timeline(failed_dir)
    keys = ("digest", "step", "data_order", "position")
    same = all(all(a[k] == b[k] for k in keys) for a, b in zip(ref, got))
    print("\nFinal state vs the failure-free run (model+optimizer digest, step, data order):")
    for a, b in zip(ref, got):
        ok = all(a[k] == b[k] for k in keys)
        print(f"  rank {a['rank']}: digest {b['digest'][:16]}  step {b['step']}  "
              f"{'identical' if ok else 'DIFFERENT'}")
    print(f"\n[demo] bit-identical: {'yes' if same else 'NO'}  "
          f"({time.time() - t0:.0f}s, run dirs under {out})")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
