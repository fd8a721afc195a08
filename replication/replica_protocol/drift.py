"""Data-parallel replicas that drift apart, seen in the fingerprints every round shares.

Each replication round already all-gathers a fingerprint of every state entry of every
rank (the announce, for dedupe). Entries that were byte-identical on a set of ranks
(data-parallel replicas: the model and optimizer under DDP, or under a plain loop with
``all_reduce_gradients``) stay identical as long as every rank applies the same update.
When ranks that matched stop matching, something broke data parallelism: a gradient
not all-reduced, a non-deterministic collective, a rank-dependent branch. The run goes
on with ranks that no longer train one model, so this module reports it at once.

Only entries declared data-parallel are watched (:meth:`DriftWatch.watch`: a DDP
module, a model passed to ``all_reduce_gradients``). Other entries go from identical to
different legitimately: a loader's state is the same on every rank until each has
consumed its own shard, a framework's loop state holds per-rank metrics. Within a
watched entry, ranks that differ from the start (batch-norm statistics in a plain
loop, FSDP shards) never matched and are never reported; replicas within groups (HSDP)
are checked within their groups. The baseline is the first round of each generation.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence


def partition(values: Sequence[int]) -> list[frozenset[int]]:
    """The ranks grouped by equal value, groups in order of their lowest rank."""
    groups: dict[int, set[int]] = {}
    for rank, v in enumerate(values):
        groups.setdefault(v, set()).add(rank)
    return sorted((frozenset(g) for g in groups.values()), key=min)


class DriftWatch:
    """Per state entry, the ranks that held it identically at the baseline round."""

    def __init__(self) -> None:
        self._watched: frozenset[str] = frozenset()
        self._baseline: dict[str, list[frozenset[int]]] = {}
        self._reported: set[str] = set()
        self._found: list[tuple[int, str, str]] = []
        self._lock = threading.Lock()

    def watch(self, names: set[str] | frozenset[str]) -> None:
        """Watch these state entries (data-parallel by the user's declaration)."""
        with self._lock:
            self._watched = frozenset(names)

    def observe(self, step: int, names: Sequence[str],
                fingerprints: Sequence[Sequence[int]]) -> None:
        """One round: ``fingerprints[rank][i]`` is rank's fingerprint of entry ``names[i]``
        (ranks whose entries are laid out differently are left out by the caller)."""
        with self._lock:
            for i, name in enumerate(names):
                if name not in self._watched:
                    continue
                now = partition([fps[i] for fps in fingerprints])
                before = self._baseline.setdefault(name, now)
                split = [g for g in before if len(g) > 1
                         and not any(g <= h for h in now)]
                if split and name not in self._reported:
                    self._reported.add(name)
                    was = " ".join(str(sorted(g)) for g in split)
                    parts = " vs ".join(str(sorted(h)) for h in now
                                        if any(h & g for g in split))
                    self._found.append((step, name, f"identical on {was}, now {parts}"))

    def take(self) -> list[tuple[int, str, str]]:
        """Drifts found since the last call: (step, entry name, which ranks split)."""
        with self._lock:
            found, self._found = self._found, []
        return found
