"""``recovery.health_check``: an unfit node is fenced before it takes work.

- A spare node whose check fails just before it would take over a lost node's ranks
  leaves the job with one line holding the command's output, takes nothing, and the
  next spare node takes the ranks; the job then finishes. ``checkpointless status``
  against that job, after the loss, shows the lost node fenced and its ranks on the
  spare node that took them.
- A training node whose check fails at start stops the job at once, with the line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import health_check
from tests.helpers.mp import free_port
from tests.launcher_scripts.harness import REPO, Agents, clean_env, events, repo_env, wait_for

SCRIPT = Path(__file__).parent / "launcher_scripts" / "watched_ddp.py"
FAST = ("recovery.heartbeat_timeout_s=5", "recovery.heartbeat_interval_s=0.2",
        "recovery.on_no_spare=stop")


@pytest.fixture
def agents(tmp_path):
    group = Agents(tmp_path)
    yield group
    group.close()


def _status(port: int, job: str, run_dir: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "status", "--rdzv-endpoint",
         f"127.0.0.1:{port}", "--rdzv-id", job, "--run-dir", str(run_dir), "--json"],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_failing_health_check_fences_a_spare_node_before_it_takes_ranks(agents, tmp_path):
    run_dir, hold, port, flag = tmp_path / "run", tmp_path / "hold", free_port(), tmp_path / "bad"

    def node(rank: int, *extra: str):
        return agents.start(
            "--nnodes", "2", "--nproc_per_node", "2", "--node-rank", str(rank),
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "health", "--run-dir",
            str(run_dir), *FAST, *extra, str(SCRIPT), "--steps", "80", "--step-sleep",
            "0.05", "--hold", str(hold), env=repo_env())

    node0, node1 = node(0), node(1)
    # Fit at start, unfit by the time it is needed: the check runs again before a takeover.
    unfit = node(2, f"recovery.health_check=echo disk /scratch is read-only; test ! -e {flag}")
    wait_for(lambda: any(int(e["step"]) >= 10 for e in events(run_dir, "step")), 120, "step 10")
    flag.touch()
    os.killpg(node1.pid, signal.SIGKILL)
    assert agents.wait(unfit, 60) == 4, agents.log(unfit)
    log = agents.log(unfit)
    line = [s for s in log.splitlines() if "failed its health check" in s]
    assert len(line) == 1 and "before taking over ranks [2, 3]" in line[0], log
    assert "disk /scratch is read-only" in line[0] and "exited with 1" in line[0]
    [failed] = events(run_dir, "health_check_failed")
    assert failed["node"] == 2 and not events(run_dir, "node_takeover")
    spare = node(3)  # the next spare node takes the ranks over
    wait_for(lambda: events(run_dir, "node_takeover"), 60, "a takeover")
    [takeover] = events(run_dir, "node_takeover")
    assert takeover["node"] == 3 and takeover["ranks"] == [2, 3]
    wait_for(lambda: all((run_dir / f"final_rank{r}.json").exists() for r in range(4)), 180,
             "every rank to finish training")
    shown = _status(port, "health", run_dir)
    states = {n["node"]: (n["state"], n["ranks"]) for n in shown["nodes"]}
    assert states[0] == ("training", [0, 1]) and states[3] == ("training", [2, 3])
    assert states[1] == ("fenced", []) and states[2][0] == "finished"
    assert any(i["cause"] == "node_lost" and "node 1" in i["where"] for i in shown["incidents"])
    hold.touch()
    assert agents.wait(node0, 60) == 0, agents.log(node0)
    assert agents.wait(spare, 60) == 0, agents.log(spare)


def test_a_training_node_that_fails_its_check_at_start_stops_the_job(agents, tmp_path):
    agent = agents.start("--standalone", "--nproc_per_node", "1", "--run-dir",
                         str(tmp_path / "run"), "recovery.health_check=echo no GPU here; exit 3",
                         str(SCRIPT), "--steps", "3", env=repo_env())
    code = agents.wait(agent, 60)
    log = agents.log(agent)
    assert code != 0, log
    assert "node 0 failed its health check at start: health check 'echo no GPU here; exit 3' " \
           "exited with 3: no GPU here" in log, log
    assert not (tmp_path / "run" / "pid_rank0").exists()  # no worker started


def test_the_check_reports_a_timeout_and_missing_output_in_one_line(monkeypatch):
    assert health_check.problem("true", cuda=False) is None
    assert health_check.problem("exit 2", cuda=False) == "health check 'exit 2' exited with 2: " \
                                                         "no output"
    noisy = health_check.problem("for i in $(seq 200); do echo line $i; done; exit 1", cuda=False)
    assert "\n" not in noisy and len(noisy) < 400 and noisy.endswith("...")
    monkeypatch.setattr(health_check, "TIMEOUT_S", 0.5)
    assert "did not finish in 0.5s" in health_check.problem("sleep 5", cuda=False)
