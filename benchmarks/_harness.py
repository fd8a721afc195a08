"""Shared plumbing for multi-process benchmarks: free ports, rank processes, JSON output."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def progress(msg: str) -> None:
    """Progress goes to stderr so the last stdout line stays the JSON result."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_ranks(module: str, world: int, args: Sequence[str], timeout_s: float = 900) -> None:
    """Run ``python -m module --rank r --world-size w --port p args`` for every rank."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, "--rank", str(r), "--world-size", str(world),
             "--port", str(port), *args],
            cwd=REPO, env=env,
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            if rc != 0:
                raise SystemExit(f"{module}: a rank exited with code {rc}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def emit(result: dict) -> None:
    """Print the result object as the final stdout line."""
    print(json.dumps(result, sort_keys=True), flush=True)


def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


# --- jobs under `checkpointless run` / torchrun (bench_recovery, bench_lightning) ----------
def job_env() -> dict[str, str]:
    """The environment of a launched job: this checkout importable, one torch thread."""
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Exit codes of ``procs`` (each started in its own session); whatever is still
    running at the deadline is killed with its whole process group."""
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


def step_done_after(out: Path, t_kill: float, step: int, world: int = 2) -> float:
    """When every rank had completed ``step`` after ``t_kill`` (from progress.jsonl)."""
    from recovery.generation.protocol import read_events

    times: dict[int, float] = {}
    for e in read_events(out / "progress.jsonl"):
        if e.get("step") == step and "event" not in e and e["ts"] > t_kill:
            times.setdefault(e["rank"], e["ts"])
    if len(times) < world:
        raise SystemExit(f"step {step} did not complete on every rank after the kill ({out})")
    return max(times.values())


def digests(out: Path, world: int = 2) -> list[str]:
    """Each rank's final state digest (``final_rank<r>.json``)."""
    return [json.loads((out / f"final_rank{r}.json").read_text())["digest"]
            for r in range(world)]
