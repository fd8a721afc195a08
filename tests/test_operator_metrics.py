"""A real Prometheus scrapes a two-node job's agents through a kill; the dashboard's
queries return data; ``checkpointless status`` reads the running job.

Two agents (``--nnodes 2``, 2 workers each, a warm spare each, ``--metrics-port``)
train the clean-room DDP loop (``tests/launcher_scripts/watched_ddp.py``) with durable
saves. Rank 3 is SIGKILLed mid-run. Debian's Prometheus scrapes both agents every
0.5 s. When training is over the workers hold until the test has read everything, so
the agents still serve the final figures. Then:

- Prometheus's query API returns a goodput and a recovery count that agree with
  ``events.jsonl`` (goodput recomputed from rank 0's ``step`` events by the same
  definition: steps gained at the median step time, over the wall time between the
  first and the newest step);
- every panel's PromQL query of ``examples/grafana/checkpointless-dashboard.json``
  returns data from this Prometheus;
- the run has no ``straggler`` event (a normal run, whatever the host's load);
- ``checkpointless status --json`` shows both nodes training, generation 1 and the
  incident with its cause.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import pytest

from tests.helpers.mp import free_port
from tests.launcher_scripts.harness import REPO, Agents, clean_env, events, repo_env, wait_for
from tests.prometheus_server import Prometheus, require

SCRIPT = Path(__file__).parent / "launcher_scripts" / "watched_ddp.py"
DASHBOARD = REPO / "examples" / "grafana" / "checkpointless-dashboard.json"
STEPS = 60
JOB = "metrics-test"
FAST = ("recovery.heartbeat_timeout_s=5", "recovery.heartbeat_interval_s=0.2",
        "recovery.straggler_window_steps=10")


@pytest.fixture
def agents(tmp_path):
    group = Agents(tmp_path)
    yield group
    group.close()


def _goodput_from_events(run_dir: Path) -> tuple[float, int]:
    """The goodput by the metric's definition, from rank 0's step events."""
    steps = [(int(e["step"]), float(e["ts"])) for e in events(run_dir, "step")
             if e.get("source") == "rank0"]
    first = min(steps, key=lambda s: s[1])
    newest = max(s for s, _ in steps)
    newest_ts = min(ts for s, ts in steps if s == newest)
    gaps = [b[1] - a[1] for a, b in pairwise(steps) if b[0] == a[0] + 1]
    return (newest - first[0]) * statistics.median(gaps) / (newest_ts - first[1]), newest


def test_prometheus_scrapes_a_two_node_job_through_a_kill(agents, tmp_path):
    require()
    run_dir, hold, port = tmp_path / "run", tmp_path / "hold", free_port()
    metric_ports = [free_port(), free_port()]
    for node in (0, 1):
        agents.start(
            "--nnodes", "2", "--nproc_per_node", "2", "--node-rank", str(node),
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", JOB, "--spares", "1",
            "--run-dir", str(run_dir), "--metrics-port", str(metric_ports[node]), *FAST,
            f"persistence.path={tmp_path / 'ckpt'}", "persistence.every_n_steps=10",
            str(SCRIPT), "--steps", str(STEPS), "--step-sleep", "0.1", "--hold", str(hold),
            env=repo_env())
    prom = Prometheus(tmp_path / "prom", [f"127.0.0.1:{p}" for p in metric_ports])
    try:
        wait_for(lambda: any(int(e["step"]) >= 15 for e in events(run_dir, "step")), 120,
                 "step 15")
        os.kill(int((run_dir / "pid_rank3").read_text()), signal.SIGKILL)
        wait_for(lambda: all((run_dir / f"final_rank{r}.json").exists() for r in range(4)),
                 120, "every rank to finish training")
        selector = f'{{job_id="{JOB}"}}'

        def final_scrape() -> bool:  # both nodes at the last step, durable saves seen,
            at_end = prom.query(f"checkpointless_step{selector} == {STEPS}")  # the store's
            saved = prom.query(f"checkpointless_durable_last_save_ok{selector}")  # figures
            recovered = prom.query(f"checkpointless_recoveries_total{selector} > 0")  # (5 s)
            return len(at_end) == 2 and len(saved) == 4 and len(recovered) == 2

        wait_for(final_scrape, 60, "Prometheus to scrape the final figures")
        expected, newest = _goodput_from_events(run_dir)
        assert newest == STEPS
        goodput = prom.value(f'checkpointless_goodput{{job_id="{JOB}",node="0"}}')
        assert goodput is not None and abs(goodput - expected) <= 0.05, (goodput, expected)
        gens = {e["gen"] for e in events(run_dir, "recovery")}
        assert prom.value(f"max(checkpointless_recoveries_total{selector})") == len(gens) >= 1
        assert prom.value(f"max(checkpointless_failures_total{selector})") >= 1
        assert prom.value(f"max(checkpointless_generation{selector})") == max(gens)
        phases = prom.query(f"checkpointless_recovery_phase_seconds_count{selector} > 0")
        assert {r["metric"]["phase"] for r in phases} == {"detect", "abort", "rendezvous",
                                                         "transfer"}
        dashboard = json.loads(DASHBOARD.read_text())
        exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
        assert len(exprs) >= 15
        empty = [e for e in exprs if not prom.query(e.replace("$job_id", JOB))]
        assert not empty, f"panels without data: {empty}"
        assert not events(run_dir, "straggler"), events(run_dir, "straggler")

        status = subprocess.run(
            [sys.executable, "-m", "launcher.cli", "status", "--rdzv-endpoint",
             f"127.0.0.1:{port}", "--rdzv-id", JOB, "--run-dir", str(run_dir), "--json"],
            cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        shown = json.loads(status.stdout)
        assert shown["generation"] == max(gens) and shown["failures"] >= 1
        assert [(n["node"], n["state"], n["ranks"]) for n in shown["nodes"]] == [
            (0, "training", [0, 1]), (1, "training", [2, 3])]
        cause = shown["incidents"][-1]
        assert cause["gen"] == 1 and cause["cause"] == "worker_exit" and "rank 3" in cause["where"]
    finally:
        hold.touch()
        prom.close()
    for proc in agents.procs:
        assert agents.wait(proc, 60) == 0, agents.log(proc)
