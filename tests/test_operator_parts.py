"""The parts of the operator's view, each on its own: the in-flight clock, a rank's
progress report, a node's goodput, the recovery events' tail, the status page, and the
status command's and the flags' bad input."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import pytest

from launcher.job_status import Incident, JobStatus, NodeStatus, render
from launcher.metrics.node_progress import NodeProgress
from launcher.metrics.recovery_events import RecoveryEvents
from launcher.run_args import add_arguments, from_namespace
from recovery.process_group.inflight_clock import InflightClock
from recovery.recipe import ConfigError, load_config
from recovery.runtime import progress_report
from recovery.runtime.progress_report import ProgressReport, read
from tests.helpers.mp import free_port
from tests.launcher_scripts.harness import REPO, clean_env


def test_the_inflight_clock_counts_overlapping_operations_once():
    clock = InflightClock()
    clock.begin()
    clock.begin()  # a second bucket while the first is in flight
    time.sleep(0.05)
    clock.end()
    time.sleep(0.05)
    clock.end()
    first = clock.total_s()
    assert 0.09 <= first < 0.5
    time.sleep(0.05)  # nothing in flight: the clock stands still
    assert clock.total_s() == first
    clock.begin()
    clock.end(5)  # a failure ends every pending operation at once; never below zero
    clock.end()
    assert clock.total_s() >= first


class _FakeClock:
    def __init__(self) -> None:
        self.waited = 0.0

    def total_s(self) -> float:
        return self.waited


def test_a_report_windows_own_time_and_counts_replays(tmp_path, monkeypatch):
    clock = _FakeClock()
    monkeypatch.setattr(progress_report, "CLOCK", clock)
    path = str(tmp_path / "r.progress")
    report = ProgressReport(path, rank=3, window_steps=4)
    for step in range(1, 9):
        clock.waited += 0.003  # each step waits ~3 ms of its wall time in collectives
        report.step_done(step)
        time.sleep(0.01)
    for step in range(7, 10):  # rolled back to 6: 7 and 8 again, then 9
        report.step_done(step)
    report.write()
    rec = read(path)
    assert rec["rank"] == 3 and rec["step"] == 9 and rec["highest_step"] == 9
    assert rec["steps_replayed"] == 2 and rec["first_step"] == 1
    [w1, w2] = rec["windows"]
    assert (w1["index"], w1["end_step"], w2["index"]) == (1, 4, 2)
    assert 0.005 <= w2["own_s"] < w2["step_s"]  # wall minus the waits
    assert read(str(tmp_path / "absent")) is None


def test_a_node_counts_goodput_from_its_first_step_across_replacements(tmp_path):
    paths = {0: str(tmp_path / "a"), 1: str(tmp_path / "b")}
    progress = NodeProgress(lambda: paths)

    def write(rank: int, **rec) -> None:
        (tmp_path / ("a" if rank == 0 else "b")).write_text(json.dumps(rec))

    # 10 steps of 1 s each in 20 s of wall time: goodput 0.5
    write(0, pid=10, first_step=1, first_ts=100.0, highest_step=11, highest_ts=120.0,
          step_s=1.0, steps_replayed=3)
    write(1, pid=11, first_step=1, first_ts=100.2, highest_step=11, highest_ts=120.1,
          step_s=1.0, steps_replayed=3)
    records = progress.read()
    assert progress.goodput(records) == pytest.approx(0.5)
    # rank 1 replaced: the new process starts later, counts replays from 0 again
    write(1, pid=12, first_step=9, first_ts=118.0, highest_step=13, highest_ts=122.0,
          step_s=1.0, steps_replayed=1)
    records = progress.read()
    assert progress.goodput(records) == pytest.approx(12 / 22)  # still from step 1 at 100 s
    assert progress.steps_replayed() == 4  # rank 1: 3 banked + 1


def test_the_recovery_tail_reads_only_this_nodes_ranks_and_waits_for_whole_lines(tmp_path):
    path = tmp_path / "events.jsonl"
    ranks = {0, 1}
    tail = RecoveryEvents(str(path), lambda: ranks)

    def event(source: str, **timings) -> str:
        return json.dumps({"event": "recovery", "source": source, "gen": 1,
                           "timings": timings}) + "\n"

    mine = event("rank1", detect_s=0.05, abort_s=0.01, rendezvous_s=0.2, transfer_s=0.1)
    other = event("rank7", detect_s=9.0, abort_s=0.0, rendezvous_s=0.0, transfer_s=0.0)
    path.write_text(json.dumps({"event": "step", "source": "rank0"}) + "\n" + other + mine[:20])
    tail.read()
    assert tail.recoveries == 0
    with open(path, "a") as f:
        f.write(mine[20:])
    tail.read()
    assert tail.recoveries == 1 and tail.total.total == pytest.approx(0.36)
    assert tail.phases["rendezvous"].cumulative()[-1] == ("+Inf", 1)
    assert dict(tail.phases["detect"].cumulative())["0.05"] == 1


def test_the_status_page_names_every_node_and_incident():
    status = JobStatus(job_id="j", store="h:1", generation=2, committed_step=90, failures=2,
                       fatal=None, read_at=time.time(), nodes=[
                           NodeStatus(0, "n0", "training", [0, 1], 97, 0.93, 4.5, 1, 1.0),
                           NodeStatus(1, "n1", "fenced", []),
                           NodeStatus(2, "n2", "training", [2, 3], 97, 0.91, 4.4, 0, 2.0)],
                       incidents=[Incident(2, "node_lost", "node 1", time.time(), 3.2, 90, False),
                                  Incident(1, "worker_exit", "rank 3, node 1", time.time(),
                                           0.2, 40, True)])
    page = render(status)
    assert "generation 2" in page and "committed step 90" in page and "4.50 steps/s" in page
    assert "fenced" in page and "node_lost" in page and "recovered in 3.20s to step 90" in page
    assert "(live: nothing replayed)" in page
    assert len(page.splitlines()) < 20


def _status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.cli", "status", *args], cwd=REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=60)


def test_status_without_a_secret_or_a_store_says_so_in_one_line(tmp_path):
    no_secret = _status("--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "x")
    assert no_secret.returncode == 2 and len(no_secret.stderr.strip().splitlines()) == 1
    assert "no job secret" in no_secret.stderr
    env = {**clean_env(), "CHECKPOINTLESS_JOB_SECRET": "a" * 64}
    started = time.monotonic()
    gone = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "status", "--rdzv-endpoint",
         f"127.0.0.1:{free_port()}", "--rdzv-id", "x", "--timeout", "1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert gone.returncode == 2 and "cannot reach the job store" in gone.stderr, gone.stderr
    assert len(gone.stderr.strip().splitlines()) == 1 and time.monotonic() - started < 30


def test_the_metrics_flag_and_the_operator_settings_are_checked():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = from_namespace(parser, parser.parse_args(
        ["--standalone", "--metrics-port", "9400", str(REPO / "examples" / "train_ddp.py")]),
        environ={})
    assert "recovery.metrics_port=9400" in args.overrides
    assert load_config(None, list(args.overrides)).recovery.metrics_port == 9400
    with pytest.raises(ConfigError, match="stragglers"):
        load_config(None, ["recovery.stragglers=sometimes"])
    with pytest.raises(ConfigError, match="metrics_port"):
        load_config(None, ["recovery.metrics_port=70000"])
