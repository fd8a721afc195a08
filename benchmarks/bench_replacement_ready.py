"""How soon the replacement of a lost worker or node is ready and training resumes, for
scripts whose imports are not the runtime's own: a Hugging Face GPT-2 and Lightning's
``BoringModel``.

Both jobs run as their users would run them, at the default settings, on 2 nodes x 2
workers with one warm spare per node and one spare node (three agents on this machine):

- ``hf``: ``benchmarks/hf_worker.py``, a 2-layer ``transformers`` GPT-2 from a config
  (random init, nothing downloaded) under DDP; a replacement builds it on the meta
  device (``is_replacement()``);
- ``boring``: ``tests/lightning_scripts/demo_models.py --model boring``, Lightning's own
  ``BoringModel`` under ``Trainer(strategy="checkpointless")``.

Each job runs three times, side by side in one run: failure-free (the reference), with
rank 1 SIGKILLed at step K's backward (``worker_kill``: a warm spare on node 0 takes
it), and with rank 2's whole node SIGKILLed there (``node_loss``: agent, workers and
spares; the spare node takes ranks 2 and 3). For each failure:

- ``replacement_ready_s``: from the kill to the moment the last replacement reached
  ``Checkpointless(...)`` (its ``failure_detected`` event of kind ``replacement``: the
  script's imports and model construction are behind it);
- ``resume_s``: from the kill to the last replacement's ``resumed`` event;
- ``detect_s`` (node loss): from the kill to the first ``node_lost``;
- ``script_prefix_s``: from a rank's assignment to a spare to that spare's
  ``Checkpointless(...)``: the script's own prefix (imports left, model construction),
  the most that running the prefix before the failure could save (ADR 0046);
- ``bit_identical``: every rank's final digest equals the failure-free run's.

Targets (quick mode as well as full): a worker kill resumes within 1.0 s, a node loss
within 5 s. ``meets_targets`` is true only when every failure of both jobs met its
target and ended bit-identical. What it does not capture: a shared filesystem (imports
come from a local page cache; a cluster's take 10-60 s, which the preload moves before
the failure), GPUs, and real network latency. The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._harness import emit, median, progress
from recovery.common.events import Event
from tests.recovery_harness import JobResult, run_job

KILL_STEP = 8
TARGET_S = {"worker_kill": 1.0, "node_loss": 5.0}
FAULTS = {"worker_kill": f"1:{KILL_STEP}:backward", "node_loss": f"2:{KILL_STEP}:backward:node"}


def job_args(job: str, out: Path, steps: int) -> tuple[str, tuple[str, ...]]:
    """(script, its arguments) of one of the two jobs."""
    if job == "hf":
        return "benchmarks/hf_worker.py", ("--out", str(out), "--steps", str(steps))
    return ("tests/lightning_scripts/demo_models.py",
            ("--model", "boring", "--max-steps", str(steps), "--out", str(out)))


def run(job: str, run_dir: Path, steps: int, fault: str = "") -> JobResult:
    script, args = job_args(job, run_dir, steps)
    result = run_job(run_dir, nnodes=2, nproc=2, spares=1, spare_nodes=1, script=script,
                     script_args=args, overrides=[f"recovery.fault={fault}"] if fault else [],
                     timeout_s=300)
    failed = {n: c for n, c in result.returncodes.items() if c not in (0, -9)}
    if result.timed_out or failed:
        raise SystemExit(f"{job} run {run_dir.name} failed ({failed or 'timed out'}):\n"
                         + result.output(3000))
    return result


def digests(result: JobResult) -> dict[int, str]:
    return {r: f["digest"] for r, f in result.finals().items()}


def figures(result: JobResult, replaced: list[int]) -> dict[str, Any]:
    """The failure's timings, from the job's own events."""
    events = result.events()
    t_kill = next(float(e["ts"]) for e in events if e["event"] == Event.FAULT_INJECTED)

    def last(name: str, match: Any) -> float | None:
        """Seconds from the kill to the latest replaced rank's first ``name`` event
        after it (None if a replaced rank has none)."""
        first: dict[int, float] = {}
        for e in events:
            if (e["event"] == name and float(e["ts"]) >= t_kill and e.get("rank") in replaced
                    and match(e)):
                first.setdefault(int(e["rank"]), float(e["ts"]))
        return round(max(first.values()) - t_kill, 3) if set(first) == set(replaced) else None

    ready = last(Event.FAILURE_DETECTED,
                 lambda e: (e.get("cause") or {}).get("kind") == "replacement")
    resumed = last(Event.RESUMED, lambda e: True)
    lost = [float(e["ts"]) for e in events if e["event"] == Event.NODE_LOST]
    out: dict[str, Any] = {"replacement_ready_s": ready, "resume_s": resumed}
    # The script's own prefix on the recovery path: from a rank's assignment to a spare
    # to that spare's Checkpointless(...), the most that running the prefix before the
    # failure could save (ADR 0046).
    assigned = {int(e["rank"]): float(e["ts"]) for e in events
                if e["event"] == Event.REPLACEMENT_ASSIGNED and float(e["ts"]) >= t_kill
                and e.get("rank") in replaced}
    ready_at = {int(e["rank"]): float(e["ts"]) for e in events
                if e["event"] == Event.FAILURE_DETECTED and float(e["ts"]) >= t_kill
                and e.get("rank") in replaced
                and (e.get("cause") or {}).get("kind") == "replacement"}
    prefix = [ready_at[r] - assigned[r] for r in replaced if r in assigned and r in ready_at]
    out["script_prefix_s"] = round(max(prefix), 3) if len(prefix) == len(replaced) else None
    if lost:
        out["detect_s"] = round(min(lost) - t_kill, 3)
    zygotes = [e for e in events if e["event"] == Event.ZYGOTE_READY]
    out["preloaded_modules"] = max((len(e.get("preloaded", [])) for e in zygotes), default=0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one run of each failure")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--jobs", default="hf,boring", help="comma-separated: hf, boring")
    args = ap.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    steps = 12 if args.quick else 24
    tmp = Path(tempfile.mkdtemp(prefix="bench_replacement_ready_"))
    result: dict[str, Any] = {"kill_step": KILL_STEP, "steps": steps, "repeats": repeats,
                              "quick": args.quick, "targets_s": TARGET_S}
    ok = True
    try:
        for job in args.jobs.split(","):
            progress(f"{job}: failure-free reference")
            ref = digests(run(job, tmp / f"{job}_ref", steps))
            per_job: dict[str, Any] = {}
            for case, fault in FAULTS.items():
                replaced = [1] if case == "worker_kill" else [2, 3]
                runs = []
                for i in range(repeats):
                    progress(f"{job}: {case} ({fault}), {i + 1}/{repeats}")
                    res = run(job, tmp / f"{job}_{case}{i}", steps, fault)
                    fig = figures(res, replaced)
                    fig["bit_identical"] = digests(res) == ref
                    runs.append(fig)
                resumes = [r["resume_s"] for r in runs]
                summary: dict[str, Any] = {
                    "resume_s": median(resumes) if None not in resumes else None,
                    "script_prefix_s": median([r["script_prefix_s"] or 0.0 for r in runs]),
                    "replacement_ready_s": median([r["replacement_ready_s"] or 0.0
                                                   for r in runs]),
                    "runs": runs,
                    "bit_identical": all(r["bit_identical"] for r in runs),
                }
                if case == "node_loss":
                    summary["detect_s"] = median([r.get("detect_s", 0.0) for r in runs])
                summary["meets_target"] = (summary["resume_s"] is not None
                                           and summary["resume_s"] <= TARGET_S[case]
                                           and summary["bit_identical"])
                ok = ok and summary["meets_target"]
                per_job[case] = summary
                result[f"{job}_{case}_resume_s"] = summary["resume_s"]
                result[f"{job}_{case}_replacement_ready_s"] = summary["replacement_ready_s"]
            result[job] = per_job
        result["meets_targets"] = ok
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    emit(result)


if __name__ == "__main__":
    main()
