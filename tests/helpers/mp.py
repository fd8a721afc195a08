"""A small multi-process harness: real OS processes, real gloo, a real TCPStore.

``run_workers`` starts ``python -m <module> <json config>`` once per rank (cwd = the
repository root), waits for all of them under a deadline (optionally calling ``poll``
while they run), kills whatever is left in a ``finally`` block and returns the JSON
result each rank wrote with :func:`write_result`, its exit code and its log.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tcp_store(port: int, *, is_master: bool, timeout_s: float = 60.0):
    """A TCPStore on 127.0.0.1; the master does not wait for clients."""
    from torch.distributed import TCPStore

    return TCPStore(
        "127.0.0.1",
        port,
        is_master=is_master,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def write_result(out_dir: str, rank: int, data: dict[str, Any]) -> None:
    """Atomically write a rank's JSON result (a reader never sees half a file)."""
    path = Path(out_dir) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


@dataclass
class WorkerRun:
    results: dict[int, dict[str, Any]]
    returncodes: dict[int, int | None]
    logs: dict[int, str]
    timed_out: bool

    def describe(self) -> str:
        parts = [f"timed_out={self.timed_out} returncodes={self.returncodes}"]
        for rank, log in sorted(self.logs.items()):
            parts.append(f"--- rank {rank} log (tail) ---\n{log[-3000:]}")
        return "\n".join(parts)


def run_workers(
    module: str,
    world_size: int,
    config: dict[str, Any],
    tmp_path: Path,
    *,
    timeout_s: float = 60.0,
    poll: Callable[[], None] | None = None,
    poll_interval_s: float = 0.02,
) -> WorkerRun:
    """Run ``world_size`` worker processes of ``module`` and collect their results."""
    out = tmp_path / "results"
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    procs: dict[int, subprocess.Popen] = {}
    log_paths = {rank: tmp_path / f"rank{rank}.log" for rank in range(world_size)}
    timed_out = False
    try:
        for rank in range(world_size):
            cfg = dict(config, rank=rank, world_size=world_size, out=str(out))
            with open(log_paths[rank], "wb") as log:
                procs[rank] = subprocess.Popen(
                    [sys.executable, "-m", module, json.dumps(cfg)],
                    cwd=REPO,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs.values()):
            if time.monotonic() > deadline:
                timed_out = True
                break
            if poll is not None:
                poll()
            time.sleep(poll_interval_s)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        for p in procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
    results: dict[int, dict[str, Any]] = {}
    for rank in range(world_size):
        path = out / f"rank{rank}.json"
        if path.exists():
            results[rank] = json.loads(path.read_text())
    logs = {
        rank: path.read_text(errors="replace") if path.exists() else ""
        for rank, path in log_paths.items()
    }
    return WorkerRun(results, {r: p.returncode for r, p in procs.items()}, logs, timed_out)
