"""Start ``checkpointless run`` agents as real processes and inspect what they left.

Each agent runs in its own session, so ``os.killpg(agent.pid, SIGKILL)`` takes down a
whole simulated node (agent, workers, spares). :class:`Agents` kills every group it
started when the test ends, whatever happened.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")


def clean_env() -> dict[str, str]:
    """The test runner's environment without any CHECKPOINTLESS_* setting."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHECKPOINTLESS_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def repo_env() -> dict[str, str]:
    """:func:`clean_env` with the checkout on ``PYTHONPATH``, for scripts that import
    ``examples`` (a worker's path has the script's directory only, as under torchrun)."""
    return {**clean_env(), "PYTHONPATH": str(REPO)}


class Agents:
    """The agents of one test, each with its own log file."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []
        self.logs: dict[int, Path] = {}

    def start(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = self.tmp / f"agent{len(self.procs)}.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                [sys.executable, "-m", "launcher.cli", "run", *args],
                cwd=REPO, env=clean_env() if env is None else env, stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.logs[proc.pid] = log
        self.procs.append(proc)
        return proc

    def log(self, proc: subprocess.Popen) -> str:
        return self.logs[proc.pid].read_text(errors="replace")

    def wait(self, proc: subprocess.Popen, timeout: float = 60.0) -> int:
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill(proc)
            raise AssertionError(f"agent did not finish in {timeout}s:\n{self.log(proc)}") from None

    @staticmethod
    def kill(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def close(self) -> None:
        for proc in self.procs:
            self.kill(proc)


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def records(out: Path, rank: int) -> list[dict[str, Any]]:
    """What each process that ran ``rank`` wrote about itself, in start order."""
    path = out / f"rank{rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def events(run_dir: Path, name: str | None = None) -> list[dict[str, Any]]:
    from recovery.generation.protocol import read_events

    found = read_events(run_dir / "events.jsonl")
    return [e for e in found if name is None or e["event"] == name]
