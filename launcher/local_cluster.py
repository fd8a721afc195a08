"""Several ``checkpointless run`` agents on this machine, as several "nodes".

The demo, the benchmarks and the tests all need a multi-node job on one host. Each
agent is a real process in its own session (so killing its process group is a node
loss), started with the same rendezvous endpoint and its own ``--node-rank``. Agents
with a node rank at or above ``nnodes`` are spare nodes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class LocalCluster:
    """A job of ``nnodes`` agents (+ ``spare_nodes``) running ``command`` on this host."""

    command: Sequence[str]  # script (or -m module) and its arguments
    run_dir: Path
    nnodes: int = 2
    nproc_per_node: int = 2
    spares: int = 0  # warm spare workers per agent
    spare_nodes: int = 0
    overrides: Sequence[str] = ()  # recipe key=value
    job_id: str = "local"
    cwd: Path | None = None
    stdout: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    agents: list[subprocess.Popen] = field(default_factory=list)

    def start(self) -> LocalCluster:
        port = free_port()
        env = {**os.environ, **self.env}
        for node in range(self.nnodes + self.spare_nodes):
            cmd = [
                sys.executable, "-m", "launcher.cli", "run",
                "--nnodes", str(self.nnodes), "--nproc-per-node", str(self.nproc_per_node),
                "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", self.job_id, "--run-dir", str(self.run_dir),
                "--spares", str(self.spares), *self.overrides, *self.command,
            ]
            self.agents.append(subprocess.Popen(
                cmd, cwd=self.cwd, env=env, start_new_session=True, stdout=self.stdout,
            ))
            if node == 0:
                time.sleep(0.2)  # node 0 hosts the store; let it bind first
        return self

    def wait(self, timeout_s: float = 600) -> list[int]:
        """Exit codes of the agents that were not killed on purpose; kills on timeout."""
        deadline = time.monotonic() + timeout_s
        try:
            return [a.wait(timeout=max(0.1, deadline - time.monotonic())) for a in self.agents]
        finally:
            self.kill()

    def kill_node(self, node: int) -> None:
        """Simulate losing a node: SIGKILL its agent and every process it started."""
        _killpg(self.agents[node].pid)

    def kill(self) -> None:
        # Even agents that exited may have left workers behind in their process group.
        for a in self.agents:
            _killpg(a.pid)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
