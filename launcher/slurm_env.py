"""``checkpointless run`` inside a Slurm job step: the node rank, the node count, the
job id and the job store's endpoint, read from what ``srun`` gives each task.

Under ``srun --ntasks-per-node=1 checkpointless run ... SCRIPT`` every node's agent is
one task of the step. Each reads the step's node list (``SLURM_STEP_NODELIST``, in
Slurm's order), finds its own node in it (``SLURMD_NODENAME``), and derives:

- ``--node-rank``: its node's index in that list;
- ``--nnodes``: the step's node count, less ``--spare-nodes`` (the last nodes of the
  list wait as spare nodes, node ranks >= nnodes, as anywhere else);
- ``--rdzv-id``: ``slurm-<job id>``, with ``-r<n>`` after the n-th requeue (an etcd
  store keeps the records of the attempt before);
- ``--rdzv-endpoint``: the first node of the list, at a port derived from the job id
  (two jobs sharing a node do not collide), unless the store is etcd.

A flag given on the command line always wins over what is derived here. Outside a
step, in the batch script itself, a multi-node allocation is refused with the srun
line to use: one agent there would wait for nodes that never start.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from dataclasses import dataclass

from replication.errors import CheckpointlessError

#: The store's port under Slurm: this plus the job id modulo :data:`PORT_SPREAD`.
BASE_PORT = 29400
PORT_SPREAD = 1000


class SlurmError(CheckpointlessError, ValueError):
    """The Slurm environment cannot give this agent its place (a one-line reason)."""


@dataclass(frozen=True)
class SlurmStep:
    """The part of a Slurm job step an agent needs."""

    job_id: str
    step_id: str
    nodes: tuple[str, ...]  # the step's nodes, in Slurm's order
    node: str  # the node this task runs on
    restart_count: int  # how often the job was requeued (0: the first run)

    @property
    def node_rank(self) -> int:
        return self.nodes.index(self.node)

    @property
    def rdzv_id(self) -> str:
        return f"slurm-{self.job_id}" + (f"-r{self.restart_count}" if self.restart_count else "")

    @property
    def port(self) -> int:
        digits = re.sub(r"\D", "", self.job_id) or "0"
        return BASE_PORT + int(digits) % PORT_SPREAD


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list, expanded: ``n[0-2],gpu[08-10]`` gives ``n0 n1 n2
    gpu08 gpu09 gpu10`` (zero padding kept; several bracket groups in one name give
    every combination, in Slurm's order)."""
    names: list[str] = []
    for item in _split_top_level(text.strip()):
        names.extend(_expand_one(item, text))
    return names


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        elif c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item for item in (s.strip() for s in items) if item]


def _expand_one(item: str, whole: str) -> list[str]:
    m = re.match(r"^([^\[\]]*)\[([^\[\]]*)\](.*)$", item)
    if m is None:
        if "[" in item or "]" in item:
            raise SlurmError(f"cannot read the Slurm host list {whole!r}")
        return [item]
    prefix, ranges, rest = m.groups()
    tails = _expand_one(rest, whole) if rest else [""]
    out = []
    for part in ranges.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise SlurmError(f"cannot read the Slurm host list {whole!r}")
        width = len(lo)
        for n in range(int(lo), int(hi if sep else lo) + 1):
            out.extend(f"{prefix}{n:0{width}d}{tail}" for tail in tails)
    return out


def tasks_per_node(text: str) -> list[int]:
    """``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``) as one count per node."""
    counts: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if m is None:
            raise SlurmError(f"cannot read SLURM_STEP_TASKS_PER_NODE={text!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def detect(env: Mapping[str, str]) -> SlurmStep | None:
    """This task's step, or None outside Slurm (and for a one-node batch script, which
    runs as a single node would anywhere)."""
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job:
        return None
    if "SLURM_STEP_ID" not in env:  # the batch script itself, or salloc's shell
        nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1")
        if nodes <= 1:
            return None
        raise SlurmError(
            f"this is Slurm job {job}'s batch script, on one of its {nodes} nodes: start "
            "one agent per node with 'srun --ntasks-per-node=1 --no-kill checkpointless "
            "run ...' (examples/slurm/train.sbatch)")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    nodes = tuple(expand_hostlist(nodelist))
    node = env.get("SLURMD_NODENAME", "")
    if not nodes or node not in nodes:
        raise SlurmError(f"Slurm step {job}.{env['SLURM_STEP_ID']}: this node ({node!r}) is "
                         f"not in the step's node list {nodelist!r}")
    counts = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", "1"))
    if any(c != 1 for c in counts):
        raise SlurmError(
            f"Slurm step {job}.{env['SLURM_STEP_ID']} runs "
            f"{env.get('SLURM_STEP_TASKS_PER_NODE')} tasks per node: checkpointless run "
            "is one agent per node, which starts the workers itself; use 'srun "
            "--ntasks-per-node=1' and give the workers per node to --nproc-per-node")
    return SlurmStep(job_id=job, step_id=env["SLURM_STEP_ID"], nodes=nodes, node=node,
                     restart_count=int(env.get("SLURM_RESTART_COUNT") or 0))


def fill_in(ns: argparse.Namespace, env: Mapping[str, str]) -> str:
    """Give ``ns`` what the Slurm step says, where no flag said it; returns the line
    that describes the placement ("" outside Slurm). Raises :class:`SlurmError`."""
    spare = ns.spare_nodes
    step = None if ns.standalone else detect(env)
    if step is None:
        if spare is not None:
            raise SlurmError("--spare-nodes is read in a Slurm job step only; elsewhere a "
                             "spare node is an agent started with --node-rank >= --nnodes")
        return ""
    total = len(step.nodes)
    if spare is not None and not 0 <= spare < total:
        raise SlurmError(f"--spare-nodes {spare}: the step has {total} node(s), and at "
                         "least one must train")
    if ns.nnodes is None:
        ns.nnodes = str(total - (spare or 0))
    elif spare is not None and ns.nnodes.split(":")[0] != str(total - spare):
        raise SlurmError(f"--nnodes {ns.nnodes} and --spare-nodes {spare} do not add up to "
                         f"the step's {total} nodes (give one of them)")
    if ns.node_rank is None:
        ns.node_rank = step.node_rank
    if not ns.rdzv_id:
        ns.rdzv_id = step.rdzv_id
    if not ns.rdzv_endpoint and ns.rdzv_backend != "etcd":
        ns.rdzv_endpoint = f"{step.nodes[0]}:{step.port}"
    active = ns.nnodes.split(":")[0]
    spares = total - int(active) if active.isdigit() else 0
    return (f"checkpointless: Slurm job {step.job_id} step {step.step_id}: {total} node(s), "
            f"{active} training and {max(spares, 0)} spare; job id {ns.rdzv_id}, job store "
            f"{'in etcd' if ns.rdzv_backend == 'etcd' else 'at ' + ns.rdzv_endpoint}")
