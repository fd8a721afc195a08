"""Which rank slows the job down: each rank's own step time against the job's median.

In a synchronous job every rank's step takes the same wall time, so the signal is each
rank's *own* share of it: the step minus the time it had a collective in flight, i.e.
waiting for its peers (``recovery.process_group.inflight_clock``). Each rank reports
the median of it over every window of ``recovery.straggler_window_steps`` steps
(windows end at multiples of it, so window ``k`` covers the same steps on every rank;
``recovery.runtime.progress_report``).

Each agent publishes its ranks' windows to the job store, appended to one record per
window (``cl/steptime/w<k>``, sealed entries like the lost-node list), and judges its
own ranks only, so each straggler is reported once, by the agent that runs it: a rank
whose window median exceeds ``recovery.straggler_factor`` times the median of every
rank's, and the job's median by :data:`MIN_EXCESS_S` at least (a step of a few
milliseconds varies by more than its own length on a busy host), is a straggler for
that window. The median over a whole window means one slow step, or a few, never
makes one; the slowness must last most of the window. A window is judged once every
rank's entry is in, or two windows later with the entries there are.

With ``recovery.stragglers: replace`` the agent hands the straggler to a free warm
spare as if it had failed (the job rolls back and goes on with a fresh process); with
no spare free, it reports it only. Cost: one append per window and agent, and one read
per window and agent, of a record that grows with the world size.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from recovery.generation import protocol
from recovery.job_store import auth
from replication.side_channel import signing

#: A straggler's window median must exceed the job's by this much too (seconds).
MIN_EXCESS_S = 0.02
#: Windows whose record is kept in the store behind the newest one judged.
KEEP_WINDOWS = 4


def window_key(index: int) -> str:
    return f"{protocol.PREFIX}/steptime/w{index}"


@dataclass(frozen=True)
class Verdict:
    """One rank judged a straggler over one window."""

    rank: int
    window: int
    end_step: int
    own_s: float
    median_s: float
    ranks_compared: int

    @property
    def factor(self) -> float:
        return self.own_s / self.median_s if self.median_s > 0 else float("inf")

    def fields(self) -> dict[str, Any]:
        return {"rank": self.rank, "window": self.window, "end_step": self.end_step,
                "own_s": round(self.own_s, 6), "median_s": round(self.median_s, 6),
                "factor": round(self.factor, 3), "ranks_compared": self.ranks_compared}


def publish(store: dist.Store, index: int, rank: int, own_s: float) -> None:
    key = window_key(index)
    entry = signing.process_signer().seal(key, f"{rank}:{own_s:.6f}")
    store.append(key, b"," + entry + b",")


def entries(store: dist.Store, index: int) -> dict[int, float]:
    """Every rank's own-time median of window ``index`` (the newest entry of each)."""
    key = window_key(index)
    out: dict[int, float] = {}
    for entry in protocol.sealed_list_entries(auth.read_raw(store, key)):
        payload = auth.open_value(key, entry)
        if payload is None:
            continue
        rank, _, value = payload.partition(":")
        try:
            out[int(rank)] = float(value)
        except ValueError:
            continue
    return out


def judge(own: Mapping[int, float], all_entries: Mapping[int, float], factor: float,
          window: int, end_step: int) -> list[Verdict]:
    """This agent's ranks (``own``) that straggled, against every rank's entries."""
    if len(all_entries) < 2:
        return []
    median = statistics.median(all_entries.values())
    return [Verdict(rank, window, end_step, value, median, len(all_entries))
            for rank, value in sorted(own.items())
            if value > factor * median and value - median >= MIN_EXCESS_S]


@dataclass
class StragglerWatch:
    """One agent's side of straggler detection; the agent's loop calls :meth:`tick`."""

    world_size: Callable[[], int]
    factor: float
    published: dict[int, int] = field(default_factory=dict)  # rank -> newest window sent
    mine: dict[int, dict[int, tuple[float, int]]] = field(default_factory=dict)
    judged: int = 0  # the newest window judged
    counts: dict[int, int] = field(default_factory=dict)  # rank -> straggler windows
    factors: dict[int, float] = field(default_factory=dict)  # rank -> its newest window's

    def tick(self, store: dist.Store, records: Mapping[int, Mapping[str, Any]]) -> list[Verdict]:
        """Publish new windows of this node's ranks; judge the windows that are ready."""
        newest = 0
        for rank, rec in records.items():
            for window in rec.get("windows") or ():
                index = int(window["index"])
                newest = max(newest, index)
                if index <= max(self.published.get(rank, 0), self.judged):
                    continue  # sent already, or a replayed window judged before
                publish(store, index, rank, float(window["own_s"]))
                self.published[rank] = index
                self.mine.setdefault(index, {})[rank] = (float(window["own_s"]),
                                                         int(window["end_step"]))
        verdicts: list[Verdict] = []
        for index in sorted(i for i in self.mine if i > self.judged):
            found = entries(store, index)
            if len(found) < self.world_size() and index > newest - 2:
                break  # not every rank's entry is in yet: wait (at most two windows)
            own = {r: v for r, (v, _) in self.mine[index].items()}
            end_step = max(s for _, s in self.mine[index].values())
            if len(found) >= 2:
                median = statistics.median(found.values())
                for rank, value in own.items():
                    self.factors[rank] = value / median if median > 0 else 0.0
            for verdict in judge(own, found, self.factor, index, end_step):
                self.counts[verdict.rank] = self.counts.get(verdict.rank, 0) + 1
                verdicts.append(verdict)
            self.judged = index
            for old in [i for i in self.mine if i <= index]:
                del self.mine[old]
            if index - KEEP_WINDOWS > 0:
                try:
                    store.delete_key(window_key(index - KEEP_WINDOWS))
                except Exception:
                    pass  # another agent deleted it first
        return verdicts
