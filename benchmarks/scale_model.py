"""The model to 16,384 ranks: growth-law fits, the tree commit's critical path, the store
queue, and a node loss's recovery time composed from its parts.

Everything measurable is calibrated by ``benchmarks/bench_scale.py`` in the same run
(:class:`Calibration`); everything that is not is an :class:`Assumptions` field, stated
in ``docs/scale.md`` with its source where one exists.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from launcher.peer_link import KEEPALIVE_COUNT, KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S
from replication.replica_protocol.commit_tree import FANOUT

#: How a node is lost decides how it is seen (launcher/peer_link.py, launcher/liveness.py):
#: ``crashed``: its agent died (killed, crashed, its node's processes gone) and its kernel
#: closed the connections its watchers hold; ``silent``: the machine is off or cut off,
#: so the connections end only when TCP keepalive gives up; ``stalled``: the agent is
#: stopped or starved, its kernel answers keepalives, and only the heartbeat timeout
#: judges it.
DETECTION_KINDS = ("crashed", "silent", "stalled")


@dataclass(frozen=True)
class Calibration:
    """Measured in the bench's own run."""

    link_s: float  # gloo one-way latency of one int64 on loopback (round trip / 2)
    send_s: float  # time a gloo send call takes to return (the sender is busy this long)
    record_s: float  # rank 0's sealed set + check on the store, uncontended
    cpu_per_rank_step_s: float  # protocol CPU a rank spends in one agree (harness mean)
    request_s: float  # one store request's round trip, one client, uncontended
    per_key_s: float  # each extra key of a multi_get of join-record-sized values


@dataclass(frozen=True)
class Assumptions:
    """What the harness cannot measure here. Defaults are stated in docs/scale.md."""

    ranks_per_node: int = 8
    heartbeat_timeout_s: float = 15.0  # recovery.heartbeat_timeout_s default
    heartbeat_interval_s: float = 1.0  # recovery.heartbeat_interval_s default
    #: a held connection to a silent machine fails after this (launcher/peer_link.py)
    keepalive_s: float = KEEPALIVE_IDLE_S + KEEPALIVE_COUNT * KEEPALIVE_INTERVAL_S
    #: after a connection ended, the heartbeat must also stay still this many intervals
    link_confirm_intervals: float = 2.0
    state_bytes_per_rank: float = 8 * 2**30  # one rank's training state
    handover_copies: int = 2  # the newcomer's state + its source's (reseed, ADR 0018)
    side_bandwidth_Bps: float = 12.5e9  # per rank, gloo over TCP on a 100 Gb/s share
    pg_init_base_s: float = 2.0  # process-group re-creation, fixed part
    pg_init_s_at_16k: float = 10.0  # ... reaching this at 16,384 ranks (linear in N)
    grad_bytes_per_rank: float = 2**30  # the gradients a data-parallel rank all-reduces
    replication_factor: int = 2  # replication.factor default
    snapshot_interval_steps: int = 8  # what every_n_steps: auto picked for cheap steps here


# --- fits ---------------------------------------------------------------------------


def fit_power(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float]:
    """Least squares of log y = log a + b log x: y = a * x^b."""
    lx = [math.log(x) for x in xs]
    ly = [math.log(max(y, 1e-12)) for y in ys]
    b, la, r2 = _linreg(lx, ly)
    return {"law": "a*N^b", "a": math.exp(la), "b": b, "r2": r2}


def fit_log(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float]:
    """Least squares of y = a + b * log2 x."""
    b, a, r2 = _linreg([math.log2(x) for x in xs], list(ys))
    return {"law": "a+b*log2(N)", "a": a, "b": b, "r2": r2}


def _linreg(x: Sequence[float], y: Sequence[float]) -> tuple[float, float, float]:
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxx = sum((a - mx) ** 2 for a in x)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    slope = sxy / sxx if sxx else 0.0
    icpt = my - slope * mx
    ss_res = sum((b - (icpt + slope * a)) ** 2 for a, b in zip(x, y))
    ss_tot = sum((b - my) ** 2 for b in y)
    return slope, icpt, 1.0 - ss_res / ss_tot if ss_tot else 1.0


def evaluate(fit: dict[str, float], n: float) -> float:
    if fit["law"] == "a*N^b":
        return fit["a"] * n ** fit["b"]
    return fit["a"] + fit["b"] * math.log2(n)


def best_fit(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float | str]:
    """Both laws, and which explains the points better (higher R^2 in y's own units:
    the power law's R^2 is taken on its predictions, not on logs, to compare fairly)."""
    p, g = fit_power(xs, ys), fit_log(xs, ys)
    my = sum(ys) / len(ys)
    ss_tot = sum((y - my) ** 2 for y in ys) or 1.0

    def r2(f: dict[str, float]) -> float:
        return 1.0 - sum((y - evaluate(f, x)) ** 2 for x, y in zip(xs, ys)) / ss_tot

    p["r2_y"], g["r2_y"] = r2(p), r2(g)
    best = p if p["r2_y"] >= g["r2_y"] else g
    return {"best": best["law"], "power": p, "log": g,
            "exponent": p["b"]}  # type: ignore[dict-item]


# --- commit -------------------------------------------------------------------------


def tree_commit_s(n: int, cal: Calibration, fanout: int = FANOUT) -> float:
    """Critical path of one :class:`TreeCommit` agreement over ``n`` ranks, by the
    harness's own cost rules (a discrete-event pass over the real tree shape): a rank
    spends its protocol CPU, waits for each child's acknowledgement in turn, sends its
    own up (busy ``send_s``, arriving ``link_s`` after it began), waits for "committed"
    and passes it to each child in turn; rank 0 writes the record in between."""
    up = [0.0] * n  # when rank r's ack reaches its parent
    ready = [0.0] * n  # when rank r, acks in, has sent its own ack up
    for r in range(n - 1, -1, -1):
        t = cal.cpu_per_rank_step_s
        for c in range(fanout * r + 1, min(fanout * r + 1 + fanout, n)):
            t = max(t, up[c])
        if r == 0:
            t += cal.record_s
        else:
            up[r] = t + cal.link_s
            t += cal.send_s
        ready[r] = t
    down = [0.0] * n  # when "committed" reaches rank r
    end = 0.0
    for r in range(n):
        t = ready[r] if r == 0 else max(ready[r], down[r])
        for c in range(fanout * r + 1, min(fanout * r + 1 + fanout, n)):
            down[c] = t + cal.link_s
            t += cal.send_s
        end = max(end, t)
    return end


def ledger_commit_queue_s(requests_per_step: float, cal: Calibration) -> float:
    """The store count's commit in the store-queue model: every request of a step
    (N adds, N waits, 2 sets) is served one after another by the store's one thread,
    each taking the uncontended request time."""
    return requests_per_step * cal.request_s


def tree_store_queue_s(requests_per_step: float, cal: Calibration) -> float:
    """The tree commit's store part in the same model (rank 0's set + check)."""
    return requests_per_step * cal.request_s


# --- recovery -----------------------------------------------------------------------


def detection_s(a: Assumptions, kind: str = "crashed") -> float:
    """From the loss to its declaration, seen by a watcher that looks once per interval
    (hence the last ``+ interval`` of each):

    - ``crashed``: the connection ends at once, then the heartbeat must stay still for
      the confirmation;
    - ``silent``: the connection ends when keepalive gives up, then the confirmation;
    - ``stalled``: the heartbeat has not grown for the timeout.
    """
    confirm = a.link_confirm_intervals * a.heartbeat_interval_s
    if kind == "crashed":
        return confirm + a.heartbeat_interval_s
    if kind == "silent":
        return a.keepalive_s + confirm + a.heartbeat_interval_s
    if kind == "stalled":
        return a.heartbeat_timeout_s + a.heartbeat_interval_s
    raise ValueError(f"detection kind must be one of {DETECTION_KINDS}, not {kind!r}")


def handover_s(a: Assumptions) -> float:
    return a.handover_copies * a.state_bytes_per_rank / a.side_bandwidth_Bps


def pg_init_s(n: int, a: Assumptions) -> float:
    return a.pg_init_base_s + (a.pg_init_s_at_16k - a.pg_init_base_s) * n / 16384


def rendezvous_s(n: int, fits: dict[str, dict], cal: Calibration) -> float:
    """The store serves every request and key of the rendezvous one after another; each
    rank's own CPU (verifying records, the plan) runs in parallel on its own host, so
    the busiest rank's adds once; plus one poll interval (5 ms) to notice completion."""
    req = evaluate(fits["requests"]["power"], n)
    keys = evaluate(fits["keys"]["power"], n)
    cpu = evaluate(fits["cpu_max_rank_s"]["power"], n)
    return req * cal.request_s + keys * cal.per_key_s + cpu + 0.005


def recovery_s(n: int, fits: dict[str, dict], cal: Calibration,
               a: Assumptions, kind: str = "crashed") -> dict[str, float]:
    """A node loss with a spare node, from the loss to the resumed step: a replacement
    keeps the world's size, so the generation's communicator is made afresh for every
    rank (``pg_init_s``; ADR 0047 says why no shrink or reconfigure shortens it)."""
    parts = {"detection_s": detection_s(a, kind), "rendezvous_s": rendezvous_s(n, fits, cal),
             "handover_s": handover_s(a), "pg_init_s": pg_init_s(n, a)}
    parts["total_s"] = sum(parts.values())
    return parts


def liveness_store_load(nodes: int, req_per_agent: float, keys_per_agent: float,
                        cal: Calibration, interval_s: float) -> float:
    """Fraction of the store's time liveness takes (1.0: saturated), every agent
    beating and checking once per interval."""
    return nodes * (req_per_agent * cal.request_s + keys_per_agent * cal.per_key_s) / interval_s


def as_dict(x: Calibration | Assumptions) -> dict[str, float]:
    return dict(asdict(x))


# --- the data plane -------------------------------------------------------------------


def data_plane_bytes_per_rank_per_step(n: int, a: Assumptions) -> dict[str, float]:
    """Bytes one rank sends per training step, by where they go (default settings).

    - ``allreduce``: the gradients' all-reduce. With default settings it is the
      backend's own (a ring: 2(N-1)/N of the gradients); bit-identity after a recovery
      comes from DDP's bucket layout carried with the state (ADR 0034), not from the
      traffic. ``allreduce_ordered`` is the opt-in rank-order sum (the same 2(N-1)/N);
      ``allreduce_gather_sum`` what the all-gather-then-add it replaced sent ((N-1)x).
    - ``replication``: (k-1) copies of the rank's state per snapshot, spread over the
      snapshot interval (the chunks go to other nodes whatever N is).
    """
    ring = 2 * (n - 1) / n * a.grad_bytes_per_rank
    replication = ((a.replication_factor - 1) * a.state_bytes_per_rank
                   / a.snapshot_interval_steps)
    return {"allreduce": ring, "allreduce_ordered": ring,
            "allreduce_gather_sum": (n - 1) * a.grad_bytes_per_rank,
            "replication": replication, "total_default": ring + replication}


# --- a sharded job's live state (ADR 0049) -----------------------------------------------


@dataclass(frozen=True)
class ShardedJob:
    """An FSDP2 job of ``params`` parameters over ``n`` ranks (one shard each), with
    fp32 master weights and Adam: 4 bytes of weight and 8 of moments per parameter.
    FSDP's own traffic per step and rank: the forward's and the backward's all-gather
    of the weights (``param_bytes`` each, bf16 under mixed precision) and the
    reduce-scatter of the gradients (``grad_bytes``), each moving (N-1)/N of the whole
    model through every rank."""

    params: float = 70e9
    n: int = 64
    param_bytes: int = 2  # all-gathered weights (bf16 mixed precision)
    grad_bytes: int = 2  # reduce-scattered gradients (bf16); the log keeps the same dtype
    state_bytes_per_param: int = 12  # fp32 weight + Adam's two moments
    replication_factor: int = 2
    interval_steps: int = 64  # steps between committed snapshots (what auto picks, say)


def sharded_recovery_costs(job: ShardedJob) -> dict[str, float]:
    """Bytes per rank and step of the two ways to let a replacement go on from the live
    step, against FSDP's own traffic, and the host memory each holds per holder.

    - ``per_step_snapshot``: replicate the rank's own shard every step ((k-1) copies of
      ``state_bytes_per_param`` x P/N), so a replica of the live step always exists;
      a holder keeps two slots of it (the committed one and the one being written).
    - ``update_log``: send the optimizer's inputs every step ((k-1) copies of the
      gradient shard, ``grad_bytes`` x P/N); a holder keeps the committed replica and
      every step's log since it (up to ``interval_steps`` of them).
    """
    p, n, k = job.params, job.n, job.replication_factor
    fsdp = (2 * job.param_bytes + job.grad_bytes) * p * (n - 1) / n
    shard = p / n
    snap = (k - 1) * job.state_bytes_per_param * shard
    log = (k - 1) * job.grad_bytes * shard
    state = job.state_bytes_per_param * shard
    return {
        "fsdp_bytes_per_step": fsdp,
        "state_bytes_per_rank": state,
        "per_step_snapshot_bytes_per_step": snap,
        "per_step_snapshot_over_fsdp": snap / fsdp,
        "per_step_snapshot_holder_bytes": 2 * state * (k - 1),
        "update_log_bytes_per_step": log,
        "update_log_over_fsdp": log / fsdp,
        "update_log_holder_bytes": (k - 1) * (state + job.interval_steps * job.grad_bytes
                                              * shard),
        # how many steps of log a holder fits in memory the size of one state: the
        # budget, not the traffic, is what bounds the snapshot interval
        "update_log_steps_per_state_of_memory": state / (job.grad_bytes * shard),
        # the replacement's extra work: per-step snapshots none, the log L-C optimizer
        # steps on its own shard (no forward, no backward)
        "update_log_replay_optimizer_steps_max": job.interval_steps,
    }
