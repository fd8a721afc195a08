"""Jobs of the real launcher across network namespaces (``tests/netns.py``): one agent
per namespace, no loopback anywhere. Used by ``tests/test_partition.py`` and
``benchmarks/bench_node_loss.py``.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from recovery.generation.protocol import read_events
from tests import netns
from tests.recovery_harness import (
    REPO,
    TRAIN_ARGS,
    Agent,
    JobResult,
    agent_command,
    clean_env,
    wait_agents,
)

#: Modest detection so the jobs stay short; the agents check peers twice a second.
FAST_DETECTION = ("recovery.heartbeat_timeout_s=3", "recovery.heartbeat_interval_s=0.5")
#: Slow steps: training must still run when the spare node's ranks are ready.
SCRIPT_ARGS = (*TRAIN_ARGS, "--step-sleep", "0.4")
SECRET = "partition-test-secret-0123456789abcdef"
STORE_PORT = 29400  # any port: each namespace is a fresh network stack


def run_in_lab(lab: netns.NetLab, run_dir: Path, *, nnodes: int, spare_nodes: int,
               timeout_s: float, during: Callable[[Path], None] | None = None,
               etcd: str | None = None,
               overrides: tuple[str, ...] = FAST_DETECTION) -> JobResult:
    """:func:`tests.recovery_harness.run_job`, with node ``n``'s agent in namespace ``n``
    and the endpoint on node 0's veth address (no loopback anywhere); with ``etcd``
    (``HOST:PORT,...``) the job's store is that etcd cluster instead. ``overrides``:
    the recipe's, a 3 s heartbeat timeout unless given."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**clean_env(), "CHECKPOINTLESS_JOB_SECRET": SECRET}
    endpoint = f"{lab.addr(0)}:{STORE_PORT}"
    agents: dict[int, Agent] = {}
    logs = run_dir / "logs"
    logs.mkdir()
    t0 = time.monotonic()
    timed_out = False
    try:
        for node in range(nnodes + spare_nodes):
            cmd = agent_command(node_rank=node, nnodes=nnodes, nproc=2, run_dir=run_dir,
                                endpoint=endpoint, rdzv_id=f"part{os.getpid()}-{run_dir.name}",
                                spares=0,
                                overrides=overrides, script="examples/train_gpt.py",
                                script_args=SCRIPT_ARGS, etcd=etcd)
            out, err = logs / f"agent{node}.out", logs / f"agent{node}.err"
            with open(out, "wb") as fo, open(err, "wb") as fe:
                proc = subprocess.Popen([*lab.prefix(node), *cmd], cwd=REPO, env=env,
                                        stdin=subprocess.DEVNULL, stdout=fo, stderr=fe,
                                        start_new_session=True)
            agents[node] = Agent(node, proc, out, err)
        if during is not None:
            during(run_dir)
        timed_out = wait_agents(agents, t0 + timeout_s)
    finally:
        for agent in agents.values():
            if agent.proc.poll() is None:
                agent.kill()
    return JobResult(run_dir=run_dir, world_size=nnodes * 2,
                     returncodes={n: a.proc.returncode for n, a in agents.items()},
                     agents=agents, elapsed_s=time.monotonic() - t0, timed_out=timed_out)


def wait_events(run_dir: Path, until: Callable[[list[dict]], bool], what: str,
                 timeout_s: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    path = run_dir / "events.jsonl"
    while time.monotonic() < deadline:
        found = read_events(path) if path.exists() else []
        if until(found):
            return found
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
