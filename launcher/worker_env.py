"""The environment of a worker process: torchrun's variables plus the runtime's own.

A script (or Lightning) must see an ordinary torchelastic launch, so every variable
torchrun sets is set here with the same meaning. On top of that, the runtime gets the
job store, its physical node, the run directory, its heartbeat file and the resolved
config (the ``CHECKPOINTLESS_INTERNAL_*`` names from :mod:`recovery.generation.protocol`).

``TORCHELASTIC_USE_AGENT_STORE`` is ``True``, as torchrun's c10d rendezvous sets it:
MASTER_ADDR/MASTER_PORT name the store node 0's agent already hosts, so a worker's
``init_process_group("env://")`` must connect to it as a client. With ``False`` rank 0
would try to host a second server on the same port and fail with EADDRINUSE.

The job key (sealing the store records the job trusts, ``replication.side_channel.signing``) reaches
workers in ``CHECKPOINTLESS_INTERNAL_JOB_KEY``; the job secret it is derived from
(``CHECKPOINTLESS_JOB_SECRET``) is removed, so workers never hold it. ``GLOO_SOCKET_IFNAME``
is set to the interface ``--bind`` chose, unless the user set it, and NCCL's watchdog
is told never to kill a survivor (:func:`nccl_error_handling`). Under Slurm, the
variables of the agent's own task are removed (:data:`SLURM_TASK_VARS`).

The environment is built in two layers: :meth:`JobEnv.base` (job-wide, no rank), which
is also what a warm spare is started with, and :meth:`JobEnv.for_rank`, which a spare
applies to itself on assignment. Only the rank layer may differ between processes of
one node, so nothing a spare imported before assignment saw the wrong job.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from launcher import worker_output
from recovery.job_store.store_address import ETCD_SCHEME
from recovery.recipe import RESERVED_ENV_PREFIX
from replication import contract
from replication.contract import ENV_JOB_SECRET

ROLE_NAME = "default"

#: Slurm's variables that describe a task of the step, which is the agent, not a
#: worker. A library that reads them would place every worker where the agent is:
#: ``SLURM_PROCID`` as the global rank, ``SLURM_NTASKS`` as the world size. (Lightning
#: does not: it looks for torchrun's variables before Slurm's.) torchrun's variables
#: describe the workers; the job's Slurm variables (``SLURM_JOB_ID``, the node list) stay.
SLURM_TASK_VARS = frozenset({
    "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
    "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_STEP_NUM_TASKS",
    "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASK_PID", "SLURM_GTIDS",
})


#: How ProcessGroupNCCL's watchdog handles a collective's error or timeout (torch's
#: ``TORCH_NCCL_ASYNC_ERROR_HANDLING``; ``NCCL_ASYNC_ERROR_HANDLING`` is its older name):
#: 0 nothing, 1 abort the communicator and tear the process down, 2 abort the
#: communicator only, 3 tear the process down without aborting. Workers get 2. A
#: survivor often notices a dead peer in NCCL before the runtime declares the failure;
#: 1 and 3 then kill it, turning one lost rank into several. 2 keeps the process and
#: aborts the failed generation's communicator, so its kernels stop spinning on the GPU
#: and the pending collective raises, which the runtime takes as the peer's failure and
#: recovers from in place (the next generation gets a new communicator). 0 would leave
#: those kernels running until the runtime's own abort.
NCCL_ERROR_HANDLING_VARS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")
NCCL_ERROR_HANDLING = "2"
NCCL_TEAR_DOWN = frozenset({"1", "3"})
_warned_tear_down = False


def nccl_error_handling(env: dict[str, str]) -> None:
    """Set the watchdog's mode in ``env`` unless the user chose one (either name); warn
    once per process when that choice kills survivors."""
    global _warned_tear_down
    chosen = [(k, env[k].strip()) for k in NCCL_ERROR_HANDLING_VARS if k in env]
    if not chosen:
        env[NCCL_ERROR_HANDLING_VARS[0]] = NCCL_ERROR_HANDLING
        return
    name, value = chosen[0]  # torch reads the first name when both are set
    if value in NCCL_TEAR_DOWN and not _warned_tear_down:
        _warned_tear_down = True
        worker_output.say(
            f"[checkpointless] {name}={value} makes NCCL's watchdog kill a worker that sees "
            "a peer fail, so survivors die instead of recovering in place; unset it to let "
            f"the runtime recover (it uses {NCCL_ERROR_HANDLING}: abort the communicator, "
            "keep the process)")


@dataclass(frozen=True)
class JobEnv:
    """Job-wide facts every worker of this agent gets."""

    store_host: str
    store_port: int
    nproc: int
    nnodes: int
    node: int  # the physical node (agent) id, even for ranks taken over from another node
    run_id: str
    max_restarts: int
    run_dir: str
    config_json: str
    job_key: str = field(default="", repr=False)  # hex; never printed
    gloo_ifname: str | None = None  # GLOO_SOCKET_IFNAME unless the user set one
    #: The job store as workers reach it (``recovery.job_store.store_address``); "" means the
    #: TCPStore at store_host:store_port.
    store_address: str = ""
    #: "drain": workers ignore SIGTERM (see ``contract.ENV_ON_SIGTERM``).
    on_sigterm: str = "leave"

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    def base(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """The agent's environment plus everything that does not depend on the rank."""
        src = os.environ if environ is None else environ
        env = {k: v for k, v in src.items() if not k.startswith(RESERVED_ENV_PREFIX)
               and k != ENV_JOB_SECRET and k not in SLURM_TASK_VARS}
        if self.gloo_ifname:
            env.setdefault("GLOO_SOCKET_IFNAME", self.gloo_ifname)
        if self.nproc > 1 and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = "1"  # torchrun's default: N workers must not oversubscribe
        nccl_error_handling(env)
        env.update(
            {
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_WORLD_SIZE": str(self.nproc),
                "GROUP_WORLD_SIZE": str(self.nnodes),
                "ROLE_WORLD_SIZE": str(self.world_size),
                "ROLE_NAME": ROLE_NAME,
                "MASTER_ADDR": self.store_host,
                "MASTER_PORT": str(self.store_port),
                "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
                "TORCHELASTIC_RUN_ID": self.run_id,
                # torch's env:// may reuse the agent's store only when it is a TCPStore.
                "TORCHELASTIC_USE_AGENT_STORE": str(not self.store_address.startswith(ETCD_SCHEME)),
                contract.ENV_STORE: self.store_address or f"{self.store_host}:{self.store_port}",
                contract.ENV_NODE: str(self.node),
                contract.ENV_RUN_DIR: self.run_dir,
                contract.ENV_JOB_ID: self.run_id,
                contract.ENV_CONFIG: self.config_json,
            }
        )
        if self.job_key:
            env[contract.ENV_JOB_KEY] = self.job_key
        if self.on_sigterm == "drain":
            env[contract.ENV_ON_SIGTERM] = "drain"
        return env

    def rank_vars(
        self,
        *,
        group_rank: int,
        local_rank: int,
        restart_count: int,
        heartbeat: str,
        replacement: bool,
    ) -> dict[str, str]:
        """The variables that differ per process (what a spare applies on assignment)."""
        rank = group_rank * self.nproc + local_rank
        return {
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "GROUP_RANK": str(group_rank),
            "ROLE_RANK": str(rank),
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            contract.ENV_HEARTBEAT: heartbeat,
            contract.ENV_REPLACEMENT: "1" if replacement else "0",
        }

    def for_rank(self, base: Mapping[str, str], **rank_kwargs) -> dict[str, str]:
        """``base`` (from :meth:`base`) plus :meth:`rank_vars`: a fresh worker's env."""
        return {**base, **self.rank_vars(**rank_kwargs)}
