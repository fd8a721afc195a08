"""``checkpointless run`` in a pod of a Kubernetes Indexed Job: the pod's completion
index is its node rank.

An Indexed Job (``completionMode: Indexed``) runs one pod per index and gives each its
index in ``JOB_COMPLETION_INDEX``. One pod is one node: its agent starts the node's
workers. So the index is the node rank, and indexes past ``--nnodes`` are spare nodes,
as anywhere else. Everything else (the node count, the job id, the store's endpoint)
is in the manifest's command line (``examples/kubernetes/``): unlike Slurm, Kubernetes
gives a pod no list of its peers. A ``--node-rank`` flag wins over the index.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from replication.errors import CheckpointlessError

INDEX_VAR = "JOB_COMPLETION_INDEX"


class KubernetesError(CheckpointlessError, ValueError):
    """The pod's environment cannot give this agent its place (a one-line reason)."""


def fill_in(ns: argparse.Namespace, env: Mapping[str, str]) -> str:
    """Take the node rank from the completion index where no flag gives it; returns the
    line that describes the placement ("" outside an Indexed Job)."""
    index = env.get(INDEX_VAR)
    if index is None or ns.standalone:
        return ""
    if not index.isdigit():
        raise KubernetesError(f"{INDEX_VAR}={index!r} is not a pod index (an integer >= 0)")
    if ns.node_rank is None:
        ns.node_rank = int(index)
    nnodes = (ns.nnodes or "1").split(":")[0]
    role = "spare" if nnodes.isdigit() and ns.node_rank >= int(nnodes) else "training"
    return (f"checkpointless: Kubernetes Indexed Job: pod index {index}, node rank "
            f"{ns.node_rank} of {nnodes} training node(s) ({role})")
