"""Which ranks hold the replicas of which, so that no node holds two copies of a state.

Replication factor ``k`` counts copies including the owner's own. With the ``ring``
policy, rank ``r`` on node ``n`` places its ``k-1`` replicas on nodes ``n+1 .. n+k-1``
(mod the node count), at the same local index, so every node sends and receives the
same amount and losing any ``k-1`` nodes leaves at least one copy of everything.
``spread`` strides the holders across the ring instead (nodes ``n + j*N/k``), which
keeps copies apart when failures are correlated between neighbouring nodes (a rack).
"""

from __future__ import annotations

from collections.abc import Sequence

from replication.errors import CheckpointlessError


class PlacementError(CheckpointlessError, ValueError):
    """The topology cannot honour the replication factor (message says why)."""


def nodes_of(node_of_rank: Sequence[int]) -> dict[int, list[int]]:
    """Ranks of each node, in rank order."""
    nodes: dict[int, list[int]] = {}
    for rank, node in enumerate(node_of_rank):
        nodes.setdefault(node, []).append(rank)
    return nodes


def place_replicas(
    node_of_rank: Sequence[int], factor: int, policy: str = "ring", *,
    allow_same_node: bool = False,
) -> list[list[int]]:
    """For each rank, the ranks (on ``factor-1`` distinct other nodes) holding its replicas.

    With fewer nodes than ``factor`` this refuses, unless ``allow_same_node``: then the
    copies go to other *processes*, on other nodes first, which still covers process
    failures (a single-node job) but not the loss of a whole node.
    """
    if factor < 1:
        raise PlacementError(f"replication.factor must be >= 1, got {factor}")
    if factor == 1:
        return [[] for _ in node_of_rank]
    nodes = nodes_of(node_of_rank)
    order = sorted(nodes)
    n_nodes = len(order)
    if factor > n_nodes and allow_same_node:
        return _process_placement(node_of_rank, factor, nodes, order)
    if factor > n_nodes:
        raise PlacementError(
            f"replication.factor={factor} needs at least {factor} nodes so that no node holds "
            f"two copies of the same state, but the job has {n_nodes} node(s); use "
            f"replication.factor<={n_nodes} or add nodes"
        )
    if policy not in ("ring", "spread"):
        raise PlacementError(f"unknown replication.placement {policy!r}; allowed: ring, spread")
    holders: list[list[int]] = []
    for rank, node in enumerate(node_of_rank):
        pos = order.index(node)
        local = nodes[node].index(rank)
        chosen: list[int] = []
        used_nodes = {node}
        for j in range(1, factor):
            step = j if policy == "ring" else max(1, j * n_nodes // factor)
            target_pos = (pos + step) % n_nodes
            while order[target_pos] in used_nodes:  # spread may collide on small rings
                target_pos = (target_pos + 1) % n_nodes
            target_node = order[target_pos]
            used_nodes.add(target_node)
            peers = nodes[target_node]
            chosen.append(peers[local % len(peers)])
        holders.append(chosen)
    return holders


def _process_placement(
    node_of_rank: Sequence[int], factor: int, nodes: dict[int, list[int]], order: list[int]
) -> list[list[int]]:
    world = len(node_of_rank)
    if factor > world:
        raise PlacementError(
            f"replication.factor={factor} needs at least {factor} processes, the job has {world}"
        )
    holders: list[list[int]] = []
    for rank, node in enumerate(node_of_rank):
        pos, local = order.index(node), nodes[node].index(rank)
        ring = [order[(pos + j) % len(order)] for j in range(len(order))]
        candidates: list[int] = []
        for shift in range(max(len(v) for v in nodes.values())):
            for other in ring[1:] + ring[:1]:  # other nodes first, own node last
                peers = nodes[other]
                cand = peers[(local + shift) % len(peers)]
                if cand != rank and cand not in candidates:
                    candidates.append(cand)
        holders.append(candidates[: factor - 1])
    return holders


def sources_of(holders: Sequence[Sequence[int]]) -> list[list[int]]:
    """Inverse of :func:`place_replicas`: for each rank, whose replicas it holds."""
    held: list[list[int]] = [[] for _ in holders]
    for src, hs in enumerate(holders):
        for h in hs:
            held[h].append(src)
    return held


def surviving_copies(
    holders: Sequence[Sequence[int]], node_of_rank: Sequence[int], lost_nodes: set[int]
) -> dict[int, list[int]]:
    """For each rank, the ranks still holding a copy of its state after ``lost_nodes`` die.

    A rank's own copy counts when its node survived. An empty list means that rank's
    state is gone from memory.
    """
    result: dict[int, list[int]] = {}
    for rank, hs in enumerate(holders):
        copies = [r for r in [rank, *hs] if node_of_rank[r] not in lost_nodes]
        result[rank] = copies
    return result
