"""What the operator's view costs the training step: ``recovery.metrics_port`` and friends.

The pieces that run on the training thread are the progress report's end-of-step
record (``ProgressReport.step_done``: two clock reads and a few appends) and the
in-flight clock's start and stop around every collective of the owned groups. Both are
timed here in a tight loop, and multiplied by what one step of a real job does: the
job (``benchmarks/metrics_worker.py``, a 2-layer GPT under DDP, 1 node x 2 ranks,
``checkpointless run --metrics-port``) reports its step time and how many collectives
each step began. The same job is scraped once a second (15 times Prometheus's default
rate) while it runs, and each scrape's own time is read from
``checkpointless_metrics_scrape_seconds``.

Figures: ``train_thread_cost_over_step`` (the step's own share);
``progress_write_share`` (the watchdog thread's write, once per heartbeat, over the
heartbeat interval: CPU that thread takes, under the GIL); ``scrape_share`` (the
agent's scrape time over the scrape interval, in another process). The target of
0.005 of a step is checked against ``metrics_cost_over_step``, the sum of the three as
if all of it fell on the step (an upper bound: the write and the scrape run beside it).
What it does not capture: a node with hundreds of ranks per agent (the scrape reads one
file per rank), or a Prometheus that scrapes many agents on the same host.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from benchmarks._harness import REPO, emit, free_port, job_env, progress, wait_all
from recovery.process_group.inflight_clock import InflightClock
from recovery.runtime.progress_report import ProgressReport

HEARTBEAT_S = 1.0  # recovery.heartbeat_interval_s's default: one progress write per beat
SCRAPE_S = 1.0


def per_call(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def micro(tmp: Path, n: int) -> dict:
    clock = InflightClock()

    def pair() -> None:
        clock.begin()
        clock.end()

    detail = {"gen": 3, "committed_step": 1200, "replication_lag_steps": 1,
              "memory_bytes": {"snapshots": 1 << 30, "replicas": 1 << 30, "update_logs": 0,
                               "durable_staging": 0}, "state_bytes": 1 << 29,
              "replica_bytes_sent": 1 << 29, "replica_bytes_received": 1 << 29,
              "durable": {"step": 1200, "status": "ok", "bytes": 1 << 29, "duration_s": 3.1,
                          "newest_ok_step": 1200, "saves_ok": 12, "saves_failed": 0}}
    report = ProgressReport(str(tmp / "r.progress"), 0, 50, lambda: detail)
    steps = iter(range(1, 10 ** 9))
    return {"step_done_s": per_call(lambda: report.step_done(next(steps)), n),
            "clock_pair_s": per_call(pair, n),
            "progress_write_s": per_call(report.write, max(1, n // 100))}


def scrape_loop(port: int, stop: threading.Event, seen: list[float]) -> None:
    pattern = re.compile(r"^checkpointless_metrics_scrape_seconds\{[^}]*\} (\S+)$", re.M)
    while not stop.wait(SCRAPE_S):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError:
            continue
        if (m := pattern.search(text)) and float(m.group(1)) > 0:
            seen.append(float(m.group(1)))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps, < 2 min")
    args = ap.parse_args(argv)
    steps = 150 if args.quick else 600
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        costs = micro(tmp, 20_000 if args.quick else 200_000)
        progress(f"per call: step_done {costs['step_done_s'] * 1e6:.2f} us, clock pair "
                 f"{costs['clock_pair_s'] * 1e6:.2f} us, progress write "
                 f"{costs['progress_write_s'] * 1e6:.0f} us")
        port, out = free_port(), tmp / "steps.json"
        cmd = [sys.executable, "-m", "launcher.cli", "run", "--standalone",
               "--nproc-per-node", "2", "--metrics-port", str(port), "--run-dir",
               str(tmp / "run"), str(REPO / "benchmarks" / "metrics_worker.py"),
               "--steps", str(steps), "--out", str(out)]
        progress(f"job: 2 ranks, {steps} steps, scraped every {SCRAPE_S:g} s")
        proc = subprocess.Popen(cmd, cwd=REPO, env=job_env(), start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stop, scrapes = threading.Event(), []
        scraper = threading.Thread(target=scrape_loop, args=(port, stop, scrapes), daemon=True)
        scraper.start()
        try:
            [code] = wait_all([proc], 600)
        finally:
            stop.set()
        if code != 0:
            raise SystemExit(f"bench_metrics: the job exited with {code}")
        job = json.loads(out.read_text())
    step_s = statistics.median(job["step_s"])
    ops = job["all_ops"] / job["steps"]
    train = (costs["step_done_s"] + ops * costs["clock_pair_s"]) / step_s
    write_share = costs["progress_write_s"] / HEARTBEAT_S
    scrape_s = statistics.median(scrapes) if scrapes else None
    scrape_share = scrape_s / SCRAPE_S if scrape_s is not None else None
    result = {
        "quick": args.quick, "steps": steps, "step_s": step_s,
        "collectives_per_step": round(ops, 2), **costs,
        "train_thread_cost_over_step": train, "progress_write_share": write_share,
        "scrape_s": scrape_s, "scrapes": len(scrapes), "scrape_share": scrape_share,
        "metrics_cost_over_step": train + write_share + (scrape_share or 0.0),
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    emit({k: (round(v, 9) if isinstance(v, float) else v) for k, v in result.items()})


if __name__ == "__main__":
    main()
