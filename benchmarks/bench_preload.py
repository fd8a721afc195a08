"""How soon a replacement is ready when the script imports Hugging Face ``transformers``.

Runs the same job (``benchmarks/hf_worker.py``: a 2-layer GPT-2 under DDP, 1 node x 2
workers, one warm spare) three ways, side by side in one run:

1. failure-free: the reference digest;
2. rank 1 SIGKILLed at step K's backward, with the zygote importing the script's
   modules before it forks (the default);
3. the same with ``--no-preload '*'``: the spare imports ``transformers`` and the
   script's other modules once it is assigned, as before.

For each failure, ``replacement_ready_s`` is the time from the kill to the replacement's
``Checkpointless(...)`` and ``resume_s`` the time from the kill to its ``resumed``
event; both runs must end bit-identical to the first. What it does not capture: a
shared filesystem (imports here come from a local disk's page cache, so a cluster's
10-60 s imports are much slower than these), a node loss (the spare node's zygote
imports the same way, not measured here), and GPUs. The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks._harness import REPO, digests, emit, job_env, progress, wait_all
from recovery.common.events import Event
from recovery.generation.protocol import read_events

KILL_STEP = 8


def run(out: Path, steps: int, fault: str, *flags: str) -> Path:
    out.mkdir(parents=True)
    run_dir = out / "run"
    cmd = [sys.executable, "-m", "launcher.cli", "run", "--standalone", "--nproc-per-node",
           "2", "--spares", "1", "--run-dir", str(run_dir), *flags,
           "recovery.heartbeat_timeout_s=10", *([f"recovery.fault={fault}"] if fault else []),
           str(REPO / "benchmarks" / "hf_worker.py"), "--out", str(out), "--steps", str(steps)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=job_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL)
    if any(wait_all([proc], 600)):
        raise SystemExit(f"checkpointless run failed; see {run_dir}")
    return run_dir


def figures(out: Path, run_dir: Path) -> dict:
    events = read_events(run_dir / "events.jsonl")
    fault = next(e for e in events if e["event"] == Event.FAULT_INJECTED)
    resumed = next(e for e in events if e["event"] == Event.RESUMED and e.get("rank") == 1
                   and e["ts"] > fault["ts"])
    ready = json.loads((out / "ready_rank1_1.json").read_text())["ts"]
    zygote = next((e for e in events if e["event"] == Event.ZYGOTE_READY), {})
    return {"replacement_ready_s": round(ready - fault["ts"], 3),
            "resume_s": round(resumed["ts"] - fault["ts"], 3),
            "preloaded": zygote.get("preloaded", []), "preload_s": zygote.get("preload_s")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    steps = 16 if args.quick else 30
    tmp = Path(tempfile.mkdtemp(prefix="bench_preload_"))
    try:
        progress("failure-free reference")
        run(tmp / "ref", steps, "")
        ref = digests(tmp / "ref")
        result: dict = {"kill_step": KILL_STEP, "steps": steps, "repeats": repeats,
                        "quick": args.quick}
        for name, flags in (("preload", ()), ("no_preload", ("--no-preload", "*"))):
            runs = []
            for i in range(repeats):
                progress(f"{name}: SIGKILL of rank 1 at step {KILL_STEP} ({i + 1}/{repeats})")
                out = tmp / f"{name}{i}"
                run_dir = run(out, steps, f"1:{KILL_STEP}:backward", *flags)
                fig = figures(out, run_dir)
                fig["bit_identical"] = digests(out) == ref
                runs.append(fig)
            result[name] = {
                "replacement_ready_s": sorted(r["replacement_ready_s"] for r in runs),
                "resume_s": sorted(r["resume_s"] for r in runs),
                "bit_identical": all(r["bit_identical"] for r in runs),
                "preloaded": runs[0]["preloaded"], "preload_s": runs[0]["preload_s"],
            }
        med = {n: sorted(result[n]["resume_s"])[len(result[n]["resume_s"]) // 2]
               for n in ("preload", "no_preload")}
        result["resume_ratio_preload_vs_not"] = round(med["preload"] / med["no_preload"], 3)
        result["resume_s"] = med["preload"]
        result["replacement_ready_s"] = sorted(
            result["preload"]["replacement_ready_s"])[repeats // 2]
        result["bit_identical"] = (result["preload"]["bit_identical"]
                                   and result["no_preload"]["bit_identical"])
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    emit(result)


if __name__ == "__main__":
    main()
