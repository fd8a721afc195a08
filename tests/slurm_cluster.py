"""A real Slurm cluster on this machine, for tests: one controller and N compute nodes,
each in its own network and UTS namespace (Debian's ``slurm-wlm`` 22.05 and ``munge``).

Layout (on :class:`tests.netns.NetLab`'s bridge; ``N`` compute nodes)::

    n0 .. n{N-1}   slurmd -N nK, hostname nK, address 10.213.0.(K+1)
    clctl          slurmctld, in namespace N, address 10.213.0.(N+1)

Every daemon is started as ``nsenter --net=/run/netns/X unshare --uts --mount`` plus a
``hostname`` and a bind mount of the cluster's own hosts file on ``/etc/hosts`` (so a
job resolves ``n0``, as on a cluster with DNS), never ``ip netns exec``: that remounts
``/sys``, and slurmd's cgroup probe then fails. One ``munged`` (with its own key and
socket, ``AuthInfo=socket=``) serves every node. The configuration, state, spools and
logs live in the cluster's directory; nothing of the host's ``/etc/slurm`` is used.
``cred_expire=10`` shortens the wait before a requeued job may start again (Slurm's
default is 120 s).

Client commands (sbatch, squeue, scontrol) run in the controller's namespace
(:meth:`SlurmCluster.client`). :meth:`SlurmCluster.kill_node` SIGKILLs every process
in a node's namespace, slurmd and the job's tasks with it, as a node that loses power.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests import netns
from tests.recovery_harness import (
    REPO,
    SCRIPT,
    TEST_JOB_SECRET,
    TRAIN_ARGS,
    JobResult,
    clean_env,
)

#: The batch script users submit; the tests and the benchmark run it as shipped.
TEMPLATE = REPO / "examples" / "slurm" / "train.sbatch"

BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "munged")


def available() -> str | None:
    """None if a cluster can start here, else why not."""
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing: apt-get install " \
               "slurm-wlm munge)"
    return netns.available()


@dataclass
class JobInfo:
    """``scontrol show job``'s fields that tests read."""

    job_id: str
    state: str  # COMPLETED, FAILED, RUNNING, PENDING, ...
    exit_code: str  # "0:0": the batch script's status and the signal that ended it
    restarts: int
    fields: dict[str, str]

    @property
    def status(self) -> int:
        return int(self.exit_code.split(":")[0])


@dataclass
class SlurmCluster:
    """``nodes`` compute nodes and a controller under ``root``; see the module."""

    root: Path
    nodes: int = 3
    lab: netns.NetLab | None = None
    procs: list[subprocess.Popen] = field(default_factory=list)
    node_procs: dict[int, subprocess.Popen] = field(default_factory=dict)

    @property
    def ctl(self) -> int:
        return self.nodes  # the controller's namespace index

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """What a client command (and a job, through sbatch's --export) runs with."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def node_name(self, n: int) -> str:
        return f"n{n}"

    # -- start and stop ----------------------------------------------------------------
    def start(self, timeout_s: float = 30.0) -> SlurmCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)  # munged refuses a socket directory others can write
        self.lab = netns.NetLab(self.nodes + 1, tag="slurm").start()
        try:
            self._start_munge()
            self._write_config()
            self.procs.append(self._spawn(self.ctl, "clctl",
                                          ["slurmctld", "-D", "-i", "-f", str(self.conf)]))
            for n in range(self.nodes):
                self.start_node(n)
            self.wait_idle(timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def start_node(self, n: int) -> None:
        (self.root / "spool" / self.node_name(n)).mkdir(parents=True, exist_ok=True)
        proc = self._spawn(n, self.node_name(n),
                           ["slurmd", "-D", "-N", self.node_name(n), "-f", str(self.conf)])
        self.node_procs[n] = proc
        self.procs.append(proc)

    def _start_munge(self) -> None:
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.procs.append(subprocess.Popen(
            ["munged", "-F", "--force", f"--socket={self.root / 'munge.sock'}",
             f"--key-file={key}", f"--pid-file={self.root / 'munged.pid'}",
             f"--log-file={self.root / 'munged.log'}",
             f"--seed-file={self.root / 'munged.seed'}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True))  # its own group: close() kills it with the others
        deadline = time.monotonic() + 10
        while not (self.root / "munge.sock").exists():
            if time.monotonic() > deadline or self.procs[-1].poll() is not None:
                raise RuntimeError(f"munged did not start: {self._tail('munged.log')}")
            time.sleep(0.05)

    def _write_config(self) -> None:
        assert self.lab is not None
        r = self.root
        (r / "state").mkdir(exist_ok=True)
        hosts = ["127.0.0.1 localhost"]
        hosts += [f"{self.lab.addr(n)} {self.node_name(n)}" for n in range(self.nodes)]
        hosts.append(f"{self.lab.addr(self.ctl)} clctl")
        (r / "hosts").write_text("\n".join(hosts) + "\n")
        nodes = "\n".join(
            f"NodeName={self.node_name(n)} NodeAddr={self.lab.addr(n)} CPUs=2 "
            "RealMemory=4000 State=UNKNOWN" for n in range(self.nodes))
        self.conf.write_text(f"""\
ClusterName=cltest
SlurmctldHost=clctl({self.lab.addr(self.ctl)})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={r / 'munge.sock'},cred_expire=10
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/linear
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SlurmdTimeout=10
SlurmctldTimeout=10
MinJobAge=600
KillWait=30
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}/%n
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'slurmd'}.%n.pid
SlurmctldLogFile={r / 'slurmctld.log'}
SlurmdLogFile={r / 'slurmd'}.%n.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmdParameters=config_overrides
{nodes}
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _spawn(self, ns_index: int, hostname: str, cmd: Sequence[str]) -> subprocess.Popen:
        assert self.lab is not None
        inner = (f"mount --bind {self.root / 'hosts'} /etc/hosts && hostname {hostname} && "
                 f"exec {' '.join(cmd)}")
        log = open(self.root / f"{hostname}.stderr", "ab")  # noqa: SIM115 - the child owns it
        try:
            return subprocess.Popen(
                ["nsenter", f"--net=/run/netns/{self.lab.ns(ns_index)}", "unshare", "--uts",
                 "--mount", "--propagation", "private", "sh", "-c", inner],
                env=self.env, stdout=log, stderr=log, start_new_session=True)
        finally:
            log.close()

    def wait_idle(self, timeout_s: float) -> None:
        want = {self.node_name(n) for n in range(self.nodes)}
        deadline = time.monotonic() + timeout_s
        while True:
            states = self.node_states()
            if {n for n, s in states.items() if s == "idle"} >= want:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"Slurm nodes not idle after {timeout_s:.0f}s: {states}\n"
                                   f"{self._tail('slurmctld.log')}")
            time.sleep(0.1)

    def close(self) -> None:
        if self.lab is not None:
            for n in range(self.nodes + 1):
                self._kill_namespace(n)
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()  # in case it leads no group of its own
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        if self.lab is not None:
            self.lab.close()

    # -- clients -------------------------------------------------------------------------
    def client(self, *cmd: str, timeout_s: float = 20.0, check: bool = True,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command in the controller's namespace (a login node)."""
        assert self.lab is not None
        out = subprocess.run(["nsenter", f"--net=/run/netns/{self.lab.ns(self.ctl)}", *cmd],
                             env=env or self.env, capture_output=True, text=True,
                             timeout=timeout_s)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr}")
        return out

    def node_states(self) -> dict[str, str]:
        try:
            out = self.client("sinfo", "-h", "-N", "-o", "%N %t", timeout_s=5, check=False)
        except subprocess.TimeoutExpired:  # a controller still starting blocks the client
            return {}
        return dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)

    def sbatch(self, script: Path, *options: str, env: dict[str, str] | None = None,
               args: Sequence[str] = ()) -> str:
        """Submit ``script`` with sbatch ``options`` and the script's ``args``; the job
        gets ``env`` (sbatch exports the submitting environment). Returns the job id."""
        out = self.client("sbatch", "--parsable", *options, str(script), *args, env=env)
        return out.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> JobInfo:
        out = self.client("scontrol", "-o", "show", "job", job_id)
        fields = dict(re.findall(r"(\w+)=(\S*)", out.stdout))
        return JobInfo(job_id, fields.get("JobState", "?"), fields.get("ExitCode", "?"),
                       int(fields.get("Restarts", "0") or 0), fields)

    def wait_job(self, job_id: str, timeout_s: float,
                 done: Sequence[str] = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                        "NODE_FAIL", "OUT_OF_MEMORY")) -> JobInfo:
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.job(job_id)
            if info.state in done:
                return info
            if time.monotonic() > deadline:
                with contextlib.suppress(Exception):
                    self.client("scancel", job_id, check=False)
                raise TimeoutError(f"Slurm job {job_id} still {info.state} after "
                                   f"{timeout_s:.0f}s: {info.fields}")
            time.sleep(0.2)

    def run_template(self, run_dir: Path, *overrides: str, script: str = SCRIPT,
                     script_args: Sequence[str] = TRAIN_ARGS, timeout_s: float = 180,
                     during: Callable[[str], None] | None = None,
                     ) -> tuple[JobInfo, JobResult, str]:
        """``sbatch --nodes=3`` the shipped template (``examples/slurm/train.sbatch``:
        2 training nodes + 1 spare, 2 workers each), call ``during(job_id)`` if given,
        and wait for the job to end. Returns Slurm's record of the job, the run's files
        (events, final states) and the job's output."""
        run_dir.mkdir(parents=True)
        out = run_dir / "slurm.out"
        env = {**clean_env(), "SLURM_CONF": str(self.conf), "SPARE_NODES": "1",
               "NPROC_PER_NODE": "2", "CHECKPOINTLESS": f"{sys.executable} -m launcher.cli",
               "CHECKPOINTLESS_JOB_SECRET": TEST_JOB_SECRET,
               "CHECKPOINTLESS_STATUS_FILE": str(run_dir / "status")}
        job_id = self.sbatch(
            TEMPLATE, "--nodes=3", f"--output={out}", f"--chdir={REPO}", env=env,
            args=("--run-dir", str(run_dir), "--rdzv-conf", "join_timeout=60", *overrides,
                  script, *script_args))
        if during is not None:
            during(job_id)
        info = self.wait_job(job_id, timeout_s)
        text = out.read_text() if out.exists() else ""
        job = JobResult(run_dir=run_dir, world_size=4, returncodes={}, agents={},
                        elapsed_s=0.0)
        return info, job, text

    # -- failures ------------------------------------------------------------------------
    def kill_node(self, n: int) -> list[int]:
        """SIGKILL every process in node ``n``'s namespace (slurmd and its jobs' tasks)."""
        return self._kill_namespace(n)

    def _kill_namespace(self, n: int) -> list[int]:
        assert self.lab is not None
        out = subprocess.run(["ip", "netns", "pids", self.lab.ns(n)], capture_output=True,
                             text=True, timeout=10)
        pids = [int(p) for p in out.stdout.split()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def _tail(self, name: str, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return (self.root / name).read_text()[-n:]
        return ""
