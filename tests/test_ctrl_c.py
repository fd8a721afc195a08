"""Ctrl-C ends the job with one line per node, at any moment.

A terminal's Ctrl-C sends SIGINT to the whole foreground process group: the agent, its
workers, the zygote, the spares and each rank's durable helper. Before, that printed
about 90 lines of KeyboardInterrupt tracebacks (workers, zygote, spare, "lost
sys.stderr" dumps from interpreter teardown). Here two real agents run in sessions of
their own, with spares and a durable path, and each whole group gets SIGINT: while the
command imports, while the workers start, and mid-training.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.mp import free_port
from tests.recovery_harness import REPO, clean_env

pytestmark = pytest.mark.timeout(180)

EXE = str(Path(os.sys.executable).with_name("checkpointless"))


def _start(tmp: Path) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for node in (0, 1):
        cmd = [EXE, "run", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node",
               "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "ctrl-c",
               "--spares", "1", "--run-dir", str(tmp / "run"),
               f"persistence.path={tmp / 'ckpt'}", "persistence.every_n_steps=20",
               str(REPO / "examples" / "train_gpt.py"), "--steps", "100000",
               "--out", str(tmp / "out")]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=clean_env(), text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    return procs


def _training(tmp: Path) -> bool:
    events = tmp / "run" / "events.jsonl"
    if not events.exists():
        return False
    return any(json.loads(line).get("event") == "step"
               for line in events.read_text().splitlines() if line.strip())


def _wait_training(tmp: Path) -> None:
    """Until a step event is written, then one second more: mid-training."""
    deadline = time.monotonic() + 90
    while not _training(tmp):
        assert time.monotonic() < deadline, "the job never trained"
        time.sleep(0.1)
    time.sleep(1.0)


def _signal_and_wait(procs: list[subprocess.Popen], wait, send, timeout: float
                     ) -> tuple[list[str], float]:
    """``wait()`` for the moment, ``send()`` the signal, then collect every node's
    output; SIGKILL whatever is left, whatever happened."""
    try:
        wait()
        send()
        t0 = time.monotonic()
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
        return outs, time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


@pytest.mark.parametrize("moment", ["importing", "starting", "training"])
def test_ctrl_c_stops_every_node_with_one_line(tmp_path, moment):
    waits = {"importing": lambda: time.sleep(0.4), "starting": lambda: time.sleep(2.5),
             "training": lambda: _wait_training(tmp_path)}
    procs = _start(tmp_path)
    outs, took = _signal_and_wait(
        procs, waits[moment], lambda: [os.killpg(p.pid, signal.SIGINT) for p in procs],
        timeout=30)
    assert took < 5.0, f"stopping took {took:.1f}s"
    assert [p.returncode for p in procs] == [130, 130], outs
    for node, out in enumerate(outs):
        lines = [line for line in out.splitlines()
                 if line.strip() and " loss " not in line]  # the script's own progress
        assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
        assert "lost sys.stderr" not in out, out[-3000:]
        said = [line for line in lines if "SIGINT" in line]
        assert len(said) <= 1, lines
        if moment == "training":
            assert said == [f"[checkpointless node {node}] SIGINT: stopping this node's "
                            "workers"], lines
        assert len(lines) <= 5, lines  # joined, listening, the zygote's preload, the SIGINT line


def test_sigterm_to_the_store_hosts_agent_mid_training_stops_the_job(tmp_path):
    """``kill PID`` (a scheduler's SIGTERM to the agent alone, not its group) while the
    workers train: node 0 hosts the store, so the job ends on both nodes, each with
    one line and no traceback, within seconds (exit 143 on node 0)."""
    procs = _start(tmp_path)
    outs, took = _signal_and_wait(procs, lambda: _wait_training(tmp_path),
                                  lambda: procs[0].send_signal(signal.SIGTERM), timeout=60)
    assert took < 15.0, f"stopping took {took:.1f}s"
    assert procs[0].returncode == 128 + signal.SIGTERM, outs[0][-3000:]
    assert procs[1].returncode not in (0, None), outs[1][-3000:]
    for out in outs:
        assert "Traceback" not in out, out[-3000:]
    assert "[checkpointless node 0] SIGTERM: stopping this node's workers" in outs[0]
    assert "node 0 stopped by SIGTERM" in outs[1], outs[1][-3000:]


@pytest.fixture
def sigint_not_ignored():
    """SIGINT at its default in this process while the test runs, so the children it
    starts get it too. A suite started in the background (``make test &`` from a
    non-interactive shell) inherits SIGINT ignored, and exec passes an ignored signal on:
    no Ctrl-C could then reach a starting worker, held or not."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.usefixtures("sigint_not_ignored")
@pytest.mark.parametrize("held", [True, False])
def test_ctrl_c_while_a_worker_interpreter_starts(tmp_path, capfd, held):
    """A Ctrl-C that lands while a worker's interpreter is still starting (before the
    bootstrap has any handler) is held until the bootstrap can take it: a worker the
    agent starts (``worker_procs.spawn``) leaves quietly with 130. Without the hold
    (``held=False``, the control: a plain Popen of the same command) the same signal
    kills it at start-up or prints a KeyboardInterrupt traceback."""
    from launcher import worker_output, worker_procs

    script = tmp_path / "train.py"
    script.write_text("print('the script ran')\n")
    cmd = worker_procs.python_command(str(script), [], module=False)
    env = {**clean_env(), "RANK": "0"}
    if held:
        proc = worker_procs.spawn(cmd, env)  # what the agent runs; output relayed to ours
    else:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    os.kill(proc.pid, signal.SIGINT)  # at once: the interpreter is still starting
    if held:
        proc.wait(timeout=60)
        worker_output.drain()
        out, err = capfd.readouterr()
        assert proc.returncode == 130, (proc.returncode, err[-2000:])
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
        assert "the script ran" not in out
    else:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode != 0 and (proc.returncode < 0 or "KeyboardInterrupt" in err), (
            proc.returncode, err[-2000:])
