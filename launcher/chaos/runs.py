"""Run the job under ``checkpointless run`` or under ``torchrun``, with failures, bounded.

Both runners start real processes (agents or torchrun, in sessions of their own, all
carrying the run's token from :mod:`launcher.chaos.procs`), follow the run's
timeline file while it runs, play the schedule's storage outages, and end every
process they started before returning, whatever happened (deadline, failure, a
Ctrl-C).

The checkpointless runner is also the cluster's *scheduler*: after a spare node has
taken over a lost node, it starts a new spare node (a fresh agent with the next node
rank), so that the next node loss finds one; the torchrun runner starts torchrun
again when a node loss took the whole job down.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from launcher.chaos import procs
from launcher.chaos.schedule import Fault
from launcher.chaos.storage import OutagePlayer, StorageSwitch
from launcher.local_cluster import free_port
from recovery.common.events import Event

#: The directory that holds the ``launcher`` package (the repository root in a source
#: checkout): the children's working directory and the head of their PYTHONPATH, so the
#: workload finds ``examples.gpt`` there.
REPO = Path(__file__).resolve().parents[2]
#: The soak's training script, beside this module (so it ships with the package).
WORKER = Path(__file__).resolve().with_name("workload.py")
POLL_S = 0.05
REAP_EVERY = 20  # polls between sweeps for orphaned zombies (a /proc scan each)
#: Recoveries in a row without training getting past its best step: a recovery loop.
NO_PROGRESS_RECOVERIES = 25
#: After node 0's agent (the store host) exits, how long the others get to follow.
EXIT_GRACE_S = 15.0


@dataclass(frozen=True)
class JobSpec:
    """The training job and the knobs both systems share."""

    steps: int
    dim: int = 64
    layers: int = 2
    batch: int = 8
    seq_len: int = 32
    seed: int = 0
    nnodes: int = 2
    nproc: int = 2
    heartbeat_timeout_s: float = 5.0
    heartbeat_interval_s: float = 0.5
    persist_every: int = 25  # checkpointless durable tier: every N committed steps
    spares: int = 1  # warm spare workers per active node
    warmup_steps: int = 40  # no failures before, and the measured window starts here

    @property
    def window_steps(self) -> int:
        """Steps completed inside the window (``warmup_steps`` .. ``steps``)."""
        return self.steps - self.warmup_steps

    @property
    def world(self) -> int:
        return self.nnodes * self.nproc

    def worker_args(self, mode: str, out: Path) -> list[str]:
        return [str(WORKER), "--mode", mode, "--out", str(out), "--steps", str(self.steps),
                "--dim", str(self.dim), "--layers", str(self.layers), "--batch",
                str(self.batch), "--seq-len", str(self.seq_len), "--seed", str(self.seed)]


@dataclass
class RunResult:
    name: str
    run_dir: Path
    events: list[dict[str, Any]]
    finals: dict[int, dict[str, Any]]
    returncodes: dict[str, int | None]
    timed_out: bool
    wall_s: float
    failed_reasons: list[str] = field(default_factory=list)
    outages: list[dict[str, Any]] = field(default_factory=list)
    restarts: int = 0  # scheduler restarts (torchrun) / spare nodes started (checkpointless)
    load_avg: float = 0.0  # mean 1-minute load average while it ran (others' work included)
    max_threads: int = 0  # most threads seen in one process of the run
    stragglers: list[str] = field(default_factory=list)  # still running at the end; killed
    leftovers: list[str] = field(default_factory=list)  # still running after the kill: a bug


class LoadSampler:
    """Samples the 1-minute load average every second (the machine may be shared, and a
    figure measured under someone else's load says so in its report) and, every few
    seconds, the thread count of every process of the run (a process that gains threads
    with every recovery leaks them)."""

    def __init__(self, token: str = "", threads_every: int = 5) -> None:
        self.samples: list[float] = []
        self.max_threads = 0
        self._token, self._every = token, threads_every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-load", daemon=True)

    def _run(self) -> None:
        n = 0
        while not self._stop.wait(1.0):
            self.samples.append(os.getloadavg()[0])
            n += 1
            if self._token and n % self._every == 0:
                for p in procs.tracked(self._token):
                    try:
                        self.max_threads = max(self.max_threads, p.num_threads())
                    except psutil.Error:  # gone meanwhile
                        continue

    def start(self) -> LoadSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    @property
    def mean(self) -> float:
        return round(sum(self.samples) / len(self.samples), 2) if self.samples else 0.0


class JsonlTail:
    """New complete lines of a JSON-lines file since the last call."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.records = path, 0, []  # type: ignore[var-annotated]
        self._partial = b""

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data, new = self._partial + data, []
        *lines, self._partial = data.split(b"\n")
        for line in lines:
            try:
                new.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        self.records.extend(new)
        return new


def child_env(token: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHECKPOINTLESS_")}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [
        os.environ.get("PYTHONPATH")])]), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env[procs.TOKEN_ENV] = token
    return env


def _popen(cmd: list[str], env: dict[str, str], logs: Path, name: str) -> subprocess.Popen:
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"{name}.out", "ab") as fo, open(logs / f"{name}.err", "ab") as fe:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=fo,
                                stderr=fe, start_new_session=True)


def _finals(out: Path, world: int) -> dict[int, dict[str, Any]]:
    found = {}
    for r in range(world):
        p = out / f"final_rank{r}.json"
        if p.exists():
            try:
                found[r] = json.loads(p.read_text())
            except json.JSONDecodeError:
                continue
    return found


def _finish(token: str, popens: Sequence[subprocess.Popen]) -> list[str]:
    """End everything the run started; returns what was still running before that."""
    alive = procs.describe(procs.tracked(token))
    procs.kill_tracked(token)
    for p in popens:
        if p.poll() is None:
            p.kill()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    procs.reap_orphans()
    return alive


# --- checkpointless run -------------------------------------------------------------------
def run_checkpointless(
    spec: JobSpec,
    run_dir: Path,
    *,
    deadline: float,
    faults: str = "",
    outages: Sequence[Fault] = (),
    node_losses: int = 0,
    spare_nodes: int = 1,
    spare_node_spares: int | None = None,
    warm_spares: bool = True,
    spare_node_delay_s: float = 2.0,
    extra_overrides: Sequence[str] = (),
    log: Callable[[str], None] = lambda _m: None,
) -> RunResult:
    """One job of ``spec.nnodes`` agents plus spare nodes, until done or ``deadline``.

    After each takeover a new spare node is started ``spare_node_delay_s`` later, so
    that one always waits (``node_losses``, the schedule's count, is kept for the
    report). Active agents keep ``spec.spares`` warm spare workers; spare
    nodes keep ``spare_node_spares`` (default ``nproc``: one per rank they may take over).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    token = procs.new_token(run_dir.name)
    env = child_env(token)
    storage = StorageSwitch(run_dir / "durable")
    overrides = [
        f"recovery.heartbeat_timeout_s={spec.heartbeat_timeout_s}",
        f"recovery.heartbeat_interval_s={spec.heartbeat_interval_s}",
        "recovery.max_restarts=100000",
        f"persistence.path={storage.path}",
        f"persistence.every_n_steps={spec.persist_every}",
        *extra_overrides,
    ]
    if faults:
        overrides.append(f"recovery.fault={faults}")
    endpoint = f"127.0.0.1:{free_port()}"
    spares = spec.spares if warm_spares else 0
    node_spares = spec.nproc if spare_node_spares is None else spare_node_spares
    if not warm_spares:
        node_spares = 0

    def agent_cmd(node: int) -> list[str]:
        n_sp = spares if node < spec.nnodes else node_spares
        return [sys.executable, "-m", "launcher.cli", "run", "--nnodes", str(spec.nnodes),
                "--nproc-per-node", str(spec.nproc), "--node-rank", str(node),
                "--rdzv-endpoint", endpoint, "--rdzv-id", token, "--run-dir", str(run_dir),
                "--spares", str(n_sp), "--rdzv-conf", "join_timeout=120", *overrides,
                *spec.worker_args("checkpointless", run_dir)]

    agents: dict[int, subprocess.Popen] = {}
    t0 = time.monotonic()
    timed_out = False
    tail = JsonlTail(run_dir / "events.jsonl")
    player = OutagePlayer(storage, outages, run_dir / "events.jsonl", log)
    pending_spares: list[float] = []
    spare_started = 0
    looping = ""
    load = LoadSampler(token).start()
    try:
        for node in range(spec.nnodes + spare_nodes):
            agents[node] = _popen(agent_cmd(node), env, run_dir / "logs", f"agent{node}")
            if node == 0:
                time.sleep(0.2)  # node 0 hosts the store
        next_node = spec.nnodes + spare_nodes
        takeovers = polls = 0
        best_step, stalled_gens, last_error = 0, set(), ""
        store_gone_at: float | None = None
        while True:
            now = time.monotonic()
            for e in tail.poll():
                if e.get("event") == Event.STEP and e.get("source") == "rank0":
                    player.on_step(int(e["step"]))
                    if int(e["step"]) > best_step:
                        best_step, stalled_gens = int(e["step"]), set()
                elif e.get("event") == Event.RECOVERY:
                    stalled_gens.add(e.get("gen"))
                elif e.get("event") == Event.FAILURE_DETECTED:
                    cause = e.get("cause") or {}
                    if cause.get("local"):
                        last_error = f"rank {e.get('rank')}: {cause.get('error')}"
                elif e.get("event") == Event.NODE_TAKEOVER:
                    # Keep a spare node waiting at all times: a node can also be lost
                    # without a scheduled fault (an agent starved of CPU for a whole
                    # heartbeat timeout), and the next scheduled loss must find one.
                    takeovers += 1
                    idle = spare_nodes + spare_started - takeovers + len(pending_spares)
                    if idle < max(1, min(spare_nodes, node_losses)):
                        pending_spares.append(now + spare_node_delay_s)
            player.tick()
            for when in [w for w in pending_spares if w <= now]:
                pending_spares.remove(when)
                log(f"starting spare node {next_node}")
                agents[next_node] = _popen(agent_cmd(next_node), env, run_dir / "logs",
                                           f"agent{next_node}")
                spare_started += 1
                next_node += 1
            polls += 1
            if polls % REAP_EVERY == 0:
                procs.reap_orphans(keep=[p.pid for p in agents.values()])
            if agents[0].poll() is not None and store_gone_at is None:
                store_gone_at = now
            if store_gone_at is not None and (
                all(p.poll() is not None for p in agents.values())
                or now - store_gone_at > EXIT_GRACE_S
            ):
                break
            if time.time() > deadline:
                timed_out = True
                log(f"{run_dir.name}: deadline reached, stopping the job")
                break
            if len(stalled_gens) >= NO_PROGRESS_RECOVERIES:
                looping = (f"recovery loop: {len(stalled_gens)} recoveries in a row without "
                           f"training getting past step {best_step}"
                           + (f"; the failure each time: {last_error}" if last_error else ""))
                log(f"{run_dir.name}: {looping}; stopping the job")
                break
            time.sleep(POLL_S)
    finally:
        load.stop()
        player.close()
        stragglers = _finish(token, list(agents.values()))
    tail.poll()
    events = tail.records
    reasons = [str(e.get("reason")) for e in events
               if e.get("event") in (Event.JOB_FAILED, Event.FATAL)]
    if looping:
        reasons.insert(0, looping)
    return RunResult(
        name=run_dir.name, run_dir=run_dir, events=events, finals=_finals(run_dir, spec.world),
        returncodes={f"agent{n}": p.returncode for n, p in agents.items()},
        timed_out=timed_out, wall_s=time.monotonic() - t0, failed_reasons=reasons,
        outages=player.applied, restarts=spare_started, stragglers=stragglers,
        load_avg=load.mean, max_threads=load.max_threads,
        leftovers=procs.describe(procs.tracked(token)),
    )


# --- torchrun + DCP baseline --------------------------------------------------------------
def run_torchrun(
    spec: JobSpec,
    out: Path,
    *,
    deadline: float,
    faults: str = "",
    outages: Sequence[Fault] = (),
    ckpt_every: int = 20,
    max_restarts: int = 10,
    max_scheduler_restarts: int = 0,
    log: Callable[[str], None] = lambda _m: None,
) -> RunResult:
    """The job under ``torchrun --standalone --max-restarts``, restarted by us (as a
    scheduler would) up to ``max_scheduler_restarts`` times when a node loss killed it."""
    out.mkdir(parents=True, exist_ok=True)
    token = procs.new_token(out.name)
    env = child_env(token)
    storage = StorageSwitch(out / "dcp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(spec.world), "--max-restarts", str(max_restarts), "--monitor-interval", "0.1",
           *spec.worker_args("dcp", out), "--ckpt-dir", str(storage.path), "--ckpt-every",
           str(ckpt_every), "--pg-timeout-s", str(spec.heartbeat_timeout_s)]
    if faults:
        cmd += ["--faults", faults]
    tail = JsonlTail(out / "progress.jsonl")
    player = OutagePlayer(storage, outages, out / "progress.jsonl", log)
    t0 = time.monotonic()
    timed_out = False
    launches: list[subprocess.Popen] = []
    rcs: dict[str, int | None] = {}
    reasons: list[str] = []
    polls = 0
    load = LoadSampler().start()
    try:
        while True:
            proc = _popen(cmd, env, out / "logs", f"torchrun{len(launches)}")
            launches.append(proc)
            while proc.poll() is None and not timed_out:
                for e in tail.poll():
                    if e.get("event") == Event.STEP and e.get("rank") == 0:
                        player.on_step(int(e["step"]))
                player.tick()
                polls += 1
                if polls % REAP_EVERY == 0:
                    procs.reap_orphans(keep=[p.pid for p in launches])
                if time.time() > deadline:
                    timed_out = True
                    log(f"{out.name}: deadline reached, stopping the job")
                time.sleep(POLL_S)
            rcs[f"torchrun{len(launches) - 1}"] = proc.poll()
            if timed_out or len(_finals(out, spec.world)) == spec.world:
                break
            if len(launches) > max_scheduler_restarts:
                reasons.append(f"torchrun exited with {proc.returncode} and the scheduler "
                               f"restart budget ({max_scheduler_restarts}) is spent")
                break
            procs.kill_tracked(token)  # stragglers of the dead incarnation
            _append(out / "progress.jsonl", {"ts": time.time(), "event": "scheduler_restart",
                                             "rank": -1, "exitcode": proc.returncode})
            log(f"{out.name}: torchrun exited with {proc.returncode}; starting it again")
    finally:
        load.stop()
        player.close()
        stragglers = _finish(token, launches)
    tail.poll()
    return RunResult(
        name=out.name, run_dir=out, events=tail.records, finals=_finals(out, spec.world),
        returncodes=rcs, timed_out=timed_out, wall_s=time.monotonic() - t0,
        failed_reasons=reasons, outages=player.applied, restarts=len(launches) - 1,
        stragglers=stragglers, leftovers=procs.describe(procs.tracked(token)),
        load_avg=load.mean,
    )


def _append(path: Path, record: dict[str, Any]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)
