"""Shared plumbing for multi-process benchmarks: free ports, rank processes, JSON output."""

from __future__ import annotations

import json
import os
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
