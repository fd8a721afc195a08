"""Run ``checkpointless run`` agents as real processes and read what the job left behind.

A test describes a job (how many nodes, workers per node, spare workers, spare nodes,
recipe overrides, training arguments), :func:`run_job` starts one agent per node, each
in its own session (its own process group, so ``os.killpg`` takes down a whole
simulated node), waits for all of them with a deadline, and returns a :class:`JobResult`:
exit codes, each agent's stdout/stderr, the ``final_rank<r>.json`` files and the run's
``events.jsonl``. Every process group it started is killed before it returns, whatever
happened, so a hung job can never outlive its test.

Only the public surface is used: the ``checkpointless run`` command line, the files the
training script writes and the events file (``recovery.generation.protocol.read_events``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCRIPT = "examples/train_gpt.py"

#: Small enough for a 2-core machine running 4 workers, big enough to have real state.
TRAIN_ARGS = ("--steps", "16", "--dim", "32", "--layers", "1", "--batch", "4",
              "--seq-len", "16")

#: Fields of final_rank<r>.json that must be bit-identical to a failure-free run.
FINAL_FIELDS = ("step", "digest", "data_order", "position")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env() -> dict[str, str]:
    """The runner's environment without CHECKPOINTLESS_* settings, importing this repo."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHECKPOINTLESS_")}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@dataclass
class Agent:
    node: int
    proc: subprocess.Popen
    out: Path
    err: Path

    @property
    def stderr(self) -> str:
        return self.err.read_text(errors="replace") if self.err.exists() else ""

    @property
    def stdout(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def kill(self) -> None:
        """SIGKILL the agent's whole process group (agent, workers, spares)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


@dataclass
class JobResult:
    run_dir: Path
    world_size: int
    returncodes: dict[int, int | None]  # node rank -> exit status (-9: SIGKILLed)
    agents: dict[int, Agent]
    elapsed_s: float
    timed_out: bool = False  # True: the job was still running at the deadline

    @property
    def stderr(self) -> str:
        return "\n".join(f"--- agent {n} ---\n{a.stderr}" for n, a in self.agents.items())

    def output(self, tail: int = 6000) -> str:
        """Everything the agents printed (stdout and stderr), for assertion messages."""
        text = "\n".join(f"--- agent {n} stdout ---\n{a.stdout}\n--- agent {n} stderr ---\n"
                         f"{a.stderr}" for n, a in self.agents.items())
        return text[-tail:]

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        from recovery.generation.protocol import read_events

        found = read_events(self.run_dir / "events.jsonl")
        return [e for e in found if name is None or e.get("event") == name]

    def finals(self) -> dict[int, dict[str, Any]]:
        """rank -> final_rank<r>.json (missing ranks are absent)."""
        out = {}
        for r in range(self.world_size):
            path = self.run_dir / f"final_rank{r}.json"
            if path.exists():
                out[r] = json.loads(path.read_text())
        return out


def agent_command(
    *, node_rank: int, nnodes: int, nproc: int, run_dir: Path, endpoint: str | None,
    rdzv_id: str, spares: int, overrides: tuple[str, ...], script: str,
    script_args: tuple[str, ...], etcd: str | None = None, zygote: bool = True,
) -> list[str]:
    cmd = [sys.executable, "-m", "launcher.cli", "run", "--nproc-per-node", str(nproc)]
    if etcd is not None:
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank),
                "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd, "--rdzv-id", rdzv_id]
    elif endpoint is None:
        cmd += ["--standalone"]
    else:
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank),
                "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id]
    cmd += ["--run-dir", str(run_dir), "--spares", str(spares)]
    if not zygote:
        cmd += ["--no-zygote"]  # every worker and spare a new interpreter
    # join quickly or fail: a test must never wait torchrun's 600 s for a missing node
    cmd += ["--rdzv-conf", "join_timeout=60"]
    return [*cmd, *overrides, script, *script_args]


#: The job secret the etcd tests share between their agents (a test value, not a secret).
TEST_JOB_SECRET = "0123456789abcdef" * 4


def start_agent(cmd: list[str], node: int, logs: Path,
                extra_env: dict[str, str] | None = None) -> Agent:
    logs.mkdir(parents=True, exist_ok=True)
    out, err = logs / f"agent{node}.out", logs / f"agent{node}.err"
    env = {**clean_env(), **(extra_env or {})}
    with open(out, "wb") as fo, open(err, "wb") as fe:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                stdout=fo, stderr=fe, start_new_session=True)
    return Agent(node, proc, out, err)


def wait_agents(agents: dict[int, Agent], deadline: float) -> bool:
    """Wait for every agent to exit by ``deadline`` (monotonic); True if one did not."""
    for agent in agents.values():
        try:
            agent.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return True
    return False


def run_job(
    run_dir: Path,
    *,
    nnodes: int = 1,
    nproc: int = 2,
    spares: int = 0,
    spare_nodes: int = 0,
    overrides: tuple[str, ...] | list[str] = (),
    script: str = SCRIPT,
    script_args: tuple[str, ...] = TRAIN_ARGS,
    timeout_s: float = 90.0,
    during: Callable[..., None] | None = None,
    etcd: str | None = None,
    late_spare_nodes: int = 0,
    zygote: bool = True,
) -> JobResult:
    """Run one job to completion (or ``timeout_s``), then kill whatever is left.

    ``nnodes == 1`` and no spare node runs ``--standalone``; otherwise one agent per
    node rank ``0 .. nnodes + spare_nodes - 1`` shares a fresh rendezvous endpoint
    (node 0 hosts the store, node ranks >= nnodes are spare nodes). The job's result is
    the exit codes of the agents that were not killed by the job itself.
    ``during(run_dir)``, if given, runs once every agent has started (e.g. to kill a
    worker when some condition holds); an exception from it stops the job. ``etcd``
    (``H1:P1,...``) runs the job with ``--rdzv-backend etcd`` on those members: no node
    hosts anything, and the agents share :data:`TEST_JOB_SECRET`. ``late_spare_nodes``
    spare nodes are not started with the others: ``during`` is then called as
    ``during(run_dir, start_spare_node)`` and starts each when it wants (a spare that
    joins a running job, as after a node loss). ``zygote=False`` passes ``--no-zygote``:
    every worker and spare is a new interpreter instead of a fork (ADR 0029).
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = tuple(overrides)
    standalone = nnodes == 1 and spare_nodes == 0 and late_spare_nodes == 0 and etcd is None
    endpoint = None if standalone else f"127.0.0.1:{free_port()}"
    rdzv_id = f"t{os.getpid()}-{time.monotonic_ns()}"
    agents: dict[int, Agent] = {}
    t0 = time.monotonic()
    timed_out = False

    def start(node: int) -> None:
        cmd = agent_command(node_rank=node, nnodes=nnodes, nproc=nproc, run_dir=run_dir,
                            endpoint=endpoint, rdzv_id=rdzv_id, spares=spares,
                            overrides=overrides, script=str(script),
                            script_args=script_args, etcd=etcd, zygote=zygote)
        secret = {"CHECKPOINTLESS_JOB_SECRET": TEST_JOB_SECRET} if etcd else None
        agents[node] = start_agent(cmd, node, run_dir / "logs", secret)

    def start_spare_node() -> None:
        if len(agents) >= nnodes + spare_nodes + late_spare_nodes:
            raise AssertionError(f"only {late_spare_nodes} late spare node(s) planned")
        start(len(agents))

    try:
        for node in range(nnodes + spare_nodes):
            start(node)
        if during is not None:
            during(run_dir, start_spare_node) if late_spare_nodes else during(run_dir)
        timed_out = wait_agents(agents, t0 + timeout_s)
    finally:
        for agent in agents.values():
            if agent.proc.poll() is None:
                agent.kill()
    return JobResult(
        run_dir=run_dir, world_size=nnodes * nproc,
        returncodes={n: a.proc.returncode for n, a in agents.items()},
        agents=agents, elapsed_s=time.monotonic() - t0, timed_out=timed_out,
    )


# --- assertions ----------------------------------------------------------------------
def assert_succeeded(job: JobResult, *, except_nodes: tuple[int, ...] = ()) -> None:
    """Every agent (but those a node fault killed on purpose) exited 0, in time."""
    assert not job.timed_out, f"job did not finish in time\n{job.output()}"
    bad = {n: rc for n, rc in job.returncodes.items() if n not in except_nodes and rc != 0}
    assert not bad, f"agents exited non-zero: {bad}\n{job.output()}"


def assert_same_final(reference: JobResult, job: JobResult) -> None:
    """Model+optimizer digest, step, data order and position equal the reference's."""
    ref, got = reference.finals(), job.finals()
    assert sorted(ref) == list(range(reference.world_size)), "reference run is incomplete"
    assert sorted(got) == sorted(ref), (
        f"final_rank files: expected ranks {sorted(ref)}, got {sorted(got)}\n{job.output()}"
    )
    for r in sorted(ref):
        for key in FINAL_FIELDS:
            assert got[r][key] == ref[r][key], (
                f"rank {r}: {key} differs from the failure-free run: "
                f"{got[r][key]!r} != {ref[r][key]!r}"
            )
    # A bit-identical run replays every step exactly: the run-time check must agree.
    diverged = job.events("replay_diverged") + job.events("replicas_drifted")
    assert not diverged, f"a bit-identical run was reported divergent: {diverged}"


def assert_noticed_fast(job: JobResult, victim: int, within_s: float = 3.0) -> None:
    """Every survivor of the first failure noticed it within ``within_s`` of the kill:
    a few heartbeat periods, never a collective timeout."""
    killed_at = job.events("fault_injected")[0]["ts"]
    first_gen = min(e["gen"] for e in job.events("failure_detected"))
    noticed = {e["rank"]: e["ts"] for e in job.events("failure_detected")
               if e["rank"] != victim and e["gen"] == first_gen}
    assert sorted(noticed) == sorted(set(range(job.world_size)) - {victim}), job.output()
    late = {r: round(ts - killed_at, 2) for r, ts in noticed.items() if ts - killed_at > within_s}
    assert not late, (f"survivors noticed the kill late (s): {late}; the collective timeout "
                      f"is far longer\n{job.output()}")


def assert_failed_cleanly(job: JobResult) -> None:
    """The job stopped by itself (no hang) and with a non-zero status."""
    assert not job.timed_out, f"job hung instead of stopping\n{job.output()}"
    codes = [rc for rc in job.returncodes.values() if rc is not None]
    assert codes and any(rc != 0 for rc in codes), (
        f"expected a non-zero exit, got {job.returncodes}\n{job.output()}"
    )
    assert job.returncodes.get(0) not in (0, None), (
        f"node 0 exited {job.returncodes.get(0)}\n{job.output()}"
    )


def fault_events(job: JobResult) -> list[dict[str, Any]]:
    return job.events("fault_injected")


def recovery_events(job: JobResult) -> list[dict[str, Any]]:
    return job.events("recovery")


def assert_recovered(
    job: JobResult,
    *,
    faults: int = 1,
    every_n_steps: int = 1,
    min_recoveries: int = 1,
) -> list[dict[str, Any]]:
    """The events show the injected fault(s), a recovery, and no committed step lost.

    Every recovery's target step is >= the newest step known to be committed before the
    first fault fired (so at most an interval of finished steps is replayed, the one in
    force read from the events) and not past the step the fault fired in; every rank took
    part in the last generation.
    """
    fired = fault_events(job)
    assert len(fired) == faults, f"expected {faults} fault_injected events, got {fired}"
    recs = recovery_events(job)
    gens = sorted({int(e["gen"]) for e in recs})
    assert len(gens) >= min_recoveries, f"expected a recovery, got events {recs}\n{job.output()}"
    first = min(fired, key=lambda e: e["ts"])
    committed = committed_lower_bound(job, float(first["ts"]))
    fault_step = min(int(e["step"]) for e in fired)
    gap = max(every_n_steps, snapshot_gap(job, float(first["ts"]), fault_step))
    assert committed >= fault_step - 2 * gap - 1, (
        f"only step {committed} known committed before a fault at step {fault_step}"
    )
    for e in recs:
        target = int(e["target_step"])
        assert target >= committed, (
            f"recovery gen {e['gen']} rolled back to step {target}, but step {committed} was "
            f"already committed before the fault (lost committed work)"
        )
        # A live rollback may go on from the step after a fault in a round's replication
        # phase: the round of step S runs while the rank trains S+1, whose mark can leave.
        later = int(bool(e.get("live")) and any(f.get("phase") == "replication" for f in fired))
        assert target <= fault_step + later, (
            f"target step {target} after the fault step {fault_step}")
        assert set(e["timings"]) >= {"detect_s", "abort_s", "rendezvous_s", "transfer_s"}
    # every rank of the newest generation agreed on the same target
    newest = max(gens)
    targets = {int(e["target_step"]) for e in recs if int(e["gen"]) == newest}
    assert len(targets) == 1, f"ranks disagree on the target step of gen {newest}: {targets}"
    ranks = {int(e["rank"]) for e in recs if int(e["gen"]) == newest}
    assert ranks == set(range(job.world_size)), (
        f"gen {newest}: recovery events from ranks {sorted(ranks)}, expected all of "
        f"{list(range(job.world_size))}"
    )
    return recs


def committed_lower_bound(job: JobResult, ts: float) -> int:
    """A lower bound of the committed step at time ``ts``, from rank 0's ``step`` events.

    Rank 0 emits ``step s`` after ``maybe_snapshot(s)`` returned, with ``stall_s`` set
    when step ``s`` was snapshotted; that capture waited until the round of the snapshot
    before it committed. So the second newest snapshot seen is committed (step 0 is
    committed before the first step runs), whatever the interval (``auto`` picks it as
    the job runs)."""
    snaps = sorted(int(e["step"]) for e in job.events("step")
                   if float(e["ts"]) < ts and e.get("stall_s") is not None)
    return snaps[-2] if len(snaps) >= 2 else 0


def snapshot_gap(job: JobResult, ts: float, fault_step: int) -> int:
    """The widest gap between rank 0's snapshots before ``ts``, the span from the last
    of them to ``fault_step`` included (the interval in force, as the events show it)."""
    snaps = [0, *sorted(int(e["step"]) for e in job.events("step")
                        if float(e["ts"]) < ts and e.get("stall_s") is not None)]
    return max(1, fault_step - snaps[-1], *(b - a for a, b in itertools.pairwise(snaps)))


def stop_reason(job: JobResult) -> str:
    """The ``job failed`` lines the agents printed, and the job_failed events' reasons."""
    lines = [ln for a in job.agents.values() for ln in a.stderr.splitlines()
             if "job failed" in ln]
    reasons = [str(e.get("reason", "")) for e in job.events("job_failed")]
    return "\n".join(lines + reasons)
