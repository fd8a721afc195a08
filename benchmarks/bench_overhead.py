"""The always-on cost: the runtime against plain training, in one run.

    python -m benchmarks.bench_overhead [--quick]      (last stdout line: JSON)

The same 2-rank job (``benchmarks/overhead_worker.py``: 2 nodes x 1 worker, each rank
its own state of ``state_bytes``) runs three ways, one after another, for each kind of
step:

- **plain**: under ``torchrun``, no runtime at all; its phases with ``dcp_every`` also
  time ``torch.distributed.checkpoint.async_save`` (the baseline's save cost);
- **k1**: under ``checkpointless run`` with ``replication.factor=1`` (local snapshot and
  commit only);
- **k2**: the same with ``replication.factor=2`` (a replica on the other node).

Each job runs every point of the sweep: state bytes per rank over step time from 0.05
to 2 GB/s (:data:`RATES`), snapshots every step (``every1``) and every N steps
(``everyN``). A fourth job, **default**, runs with no settings at all, exactly as a
user who knows none of the keys would: ``replication.every_n_steps`` is ``auto`` by
default (ADR 0032), so the runtime (:mod:`recovery.schedules.auto_interval`) measures its own
costs, agrees on N for ``replication.max_overhead`` (0.02) and applies it; the bench only
times the steps and reads the choices from the run's ``auto_interval`` events. The kinds of step are
``cpu`` (real compute on the host's cores, shared with the runtime) and ``device`` (the
host waits natively for an emulated device; see the worker's docstring and
docs/performance.md).

Figures (overhead = mean step time of the runtime's phase / plain's same phase - 1):

- ``overhead_<k1|k2>_<every1|everyN>_<cpu|device>_<rate>``: every point;
- ``overhead_plain_k2_every1_cpu``, ``overhead_plain_k2_every1_device``: at 0.5 GB/s;
- ``cputime_overhead_<k1|k2>_<every1|everyN>_cpu``: the same on cpu steps in CPU seconds
  per step (rank 0's process, every thread) instead of wall time: what the runtime takes
  from a host whose cores all train, and far less sensitive to other load on the host;
- ``overhead_plain_k2_nosnap_<kind>``: the runtime with no snapshot at all (its per-step
  bookkeeping: step boundary checks, events) at 0.5 GB/s;
- ``overhead_plain_default_<kind>``: the default job against plain, every step of it
  from its first (the probe's 64 steps at every 8 included) in the mean: what a user
  pays over a run of :data:`DEFAULT_STEPS` steps. Its reference is plain's mean step at
  0.5 GB/s taken twice, in the plain job before it and in a plain job right after it,
  and averaged, so the host's drift over the minutes between cancels where it is
  linear (``plain_drift_<kind>``: how far the second moved from the first);
  ``overhead_plain_default_steady_<kind>``:
  the median over whole intervals, from step :data:`AUTO_WARM` on, of their mean step
  time (``default_intervals_timed_<kind>`` of them): the cost once the interval is
  chosen; ``default_interval_steps_<kind>``, ``auto_budget``,
  ``default_reasons_<kind>`` (the runtime's own); ``overhead_default_<kind>_same_run``:
  the steady figure against that job's own steps without a snapshot;
- ``profile_k2_every1_<kind>``: where a k=2 round's time goes at 0.5 GB/s, per
  snapshot (ms): the loop's own stall (capture, wait for the previous round, fence),
  and on the round's thread the overlapped copy + hash (seal), the announce allgather,
  receive + verify, the rest of the exchange (posting sends, waiting for them), commit;
  ``added_minus_loop_stall_ms``: added time not spent in the loop's stall (on cpu steps,
  the round's CPU time taken from the step: thread contention);
- the goodput model (:mod:`benchmarks.goodput_model`) fed with these measurements and
  with the restart/recovery times of ``bench_recovery`` from
  ``benchmarks/results/latest.json``: ``crossover_mtbf_s``, ``goodput_ratio_at_mtbf_3h``
  (the default settings, at the steady state where the runtime has learnt the job's
  failure rate), ``goodput_ratio_at_mtbf_3h_estimate_x0.5`` / ``_x2`` (its estimate off
  by 2x), ``goodput_ratio_at_mtbf_3h_budget_only`` (no MTBF used at all),
  ``goodput_curve`` (a few points), and ``docs/img/goodput_vs_mtbf.png`` with ``--plot``;
- ``load_avg_1m``: the 1-minute load average before and after each job (timings taken
  under load are not comparable: this host has 2 cores and may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from itertools import pairwise
from pathlib import Path

from benchmarks import goodput_model
from benchmarks._harness import REPO, emit, free_port, job_env, median, progress, wait_all
from benchmarks.goodput_model import HOUR
from recovery.common.events import Event
from recovery.generation.protocol import read_events

RATES = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0)
QUICK_RATES = (0.5, 2.0)
KEY_RATE = 0.5
AUTO_WARM = 96
"""Steps of the default job left out of its steady figure: the policy's probe (48
steps) and its first agreement (global step 64, ``recovery.schedules.auto_interval.AGREE_EVERY``),
with margin."""
DEFAULT_STEPS = (256, 1120)
"""The default job's steps (quick, full), its probe included."""
AUTO_BUDGET = 0.02  # replication.max_overhead, its default
"""GB/s per rank of the headline keys (real LLM training under FSDP: 0.1 to 1)."""
PLAIN_AFTER = "plainafter"
"""The plain job run again after the default job, at the reference rate only."""
WORKER = str(REPO / "benchmarks" / "overhead_worker.py")


def calibrate_cpu(width: int, layers: int, targets: dict[str, float]) -> dict[str, int]:
    """Rows per batch that make a cpu step last each target (one torch thread, this
    process): a step's time is linear in the rows, ``a + b * rows``, fitted on two
    sizes. Both ranks then run at once, so real steps run a little slower; the rate
    reported is computed from the plain job's measured step time."""
    import torch

    from benchmarks.overhead_worker import build

    torch.set_num_threads(1)

    models = [build(width, layers, r, "cpu") for r in (0, 1)]

    def one(model: torch.nn.Module, opt: torch.optim.Optimizer, rows: int, out: list) -> None:
        x = torch.randn(rows, width)
        for _ in range(3):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=False)
            model(x).pow(2).mean().backward()
            opt.step()
            out.append(time.perf_counter() - t0)

    def timed(rows: int) -> float:
        """Both "ranks" at once (two threads; torch releases the GIL in its kernels), as
        the job's two processes share the cores and the memory bandwidth."""
        outs: list[list[float]] = [[], []]
        threads = [threading.Thread(target=one, args=(*models[r], rows, outs[r]))
                   for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return median(outs[0] + outs[1])

    lo, hi = 4, 256
    t_lo, t_hi = timed(lo), timed(hi)
    b = max((t_hi - t_lo) / (hi - lo), 1e-7)
    a = max(t_lo - b * lo, 0.0)
    return {name: max(1, round((t - a) / b)) for name, t in targets.items()}


def phases_for(kind: str, state_bytes: int, rates: tuple[float, ...], every_n: int,
               batches: dict[str, int], quick: bool, dcp_every: int) -> list[dict]:
    """The sweep's phases for one kind; every job (plain, k1, k2) runs the same list
    (plain ignores the intervals; ``dcp`` and ``auto`` phases are ignored where not
    meant: plain runs them as plain steps, as the references)."""
    budget_s = 1.2 if quick else 6.0  # seconds of timed steps per phase, roughly
    # Not timed: the first steps of a job run slower (allocator, caches, the runtime's
    # first slots), which would bias whichever phase came first.
    first = state_bytes / (rates[0] * 1e9)
    out = [{"kind": kind, "rate": rates[0], "step_s": first, "batch": batches.get(str(rates[0]), 1),
            "name": "warmup", "every": 1, "warm": 0,
            "steps": max(3, round((1.0 if quick else 3.0) / first))}]
    for rate in rates:
        step_s = state_bytes / (rate * 1e9)
        steps = every_n * max(1 if quick else 2,
                              min(12 if quick else 40, round(budget_s / step_s / every_n)))
        base = {"kind": kind, "rate": rate, "step_s": step_s, "batch": batches.get(str(rate), 1)}
        out.append({**base, "name": f"every1_{rate}", "every": 1, "warm": 2, "steps": steps})
        out.append({**base, "name": f"everyN_{rate}", "every": every_n, "warm": 2,
                    "steps": steps})
        if rate == KEY_RATE:
            # the runtime's own per-step work (begin/end_step, events) with no snapshot
            out.append({**base, "name": f"nosnap_{rate}", "every": 0, "warm": 2,
                        "steps": steps, "only": ["plain", "k2"]})
            out.append({**base, "name": f"dcp_{rate}", "every": 0, "dcp_every": dcp_every,
                        "only": ["plain"],
                        "warm": 2, "steps": dcp_every * (3 if quick else 8)})
            # No settings at all, as a user runs it: a job of its own (the runtime probes
            # from its first step, agrees at step 64 and every 64 steps after); every
            # step is timed, the probe's too.
            out.append({**base, "name": f"default_{rate}", "every": -2,
                        "only": ["default"],  # plain: its 0.5 GB/s phases are the reference
                        "warm": 0, "steps": DEFAULT_STEPS[0 if quick else 1]})
    return out


def runs_phase(mode: str, name: str) -> bool:
    """Which of the sweep's phases a job runs: the default job only its own (the sweep's
    fixed intervals mean nothing under auto, and k2 times them); the plain job after it
    the reference rate's plain phases again; the others all of them (each worker skips
    the phases marked for other jobs)."""
    if name == "warmup" or mode not in ("default", PLAIN_AFTER):
        return True
    if mode == "default":
        return name.startswith("default_")
    return name.endswith(f"_{KEY_RATE}") and not name.startswith(("dcp_", "default_"))


def run_job(mode: str, kind: str, out: Path, phases: list[dict], args: argparse.Namespace,
            loads: list[dict]) -> dict:
    """One job: plain under torchrun, or k1/k2 under two ``checkpointless run`` agents."""
    tag = f"{mode}_{kind}"
    job = "plain" if mode == PLAIN_AFTER else mode
    common = ["--job", job, "--kind", kind, "--out", str(out), "--tag", tag, "--phases",
              json.dumps(phases), "--width", str(args.width), "--layers", str(args.layers)]
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    if job == "plain":
        dcp_dir = out / "dcp"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", WORKER, "--mode", "plain", "--dcp-dir", str(dcp_dir),
               *common]
        procs = [subprocess.Popen(cmd, cwd=REPO, env=job_env(), start_new_session=True,
                                  stdout=subprocess.DEVNULL)]
    else:
        port = free_port()
        run_dir = out / f"run_{tag}"
        # k1 and k2 pin the factor and the interval (the phases ask for snapshots); the
        # default job sets nothing (the launcher's own flags only).
        settings = [] if mode == "default" else [
            f"replication.factor={mode[1]}", "replication.every_n_steps=1",
            "recovery.heartbeat_timeout_s=60"]
        launch = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint",
                  f"127.0.0.1:{port}", "--rdzv-id", f"ovh-{tag}-{port}", "--run-dir",
                  str(run_dir), *settings]
        procs = [subprocess.Popen([sys.executable, "-m", "launcher.cli", "run", "--node-rank",
                                   str(n), *launch, WORKER, "--mode", "runtime",
                                   *(["--profile"] if args.profile else []), *common],
                                  cwd=REPO, env=job_env(), start_new_session=True,
                                  stdout=subprocess.DEVNULL)
                 for n in (0, 1)]
    rcs = wait_all(procs, args.job_timeout_s)
    if any(rcs):
        raise SystemExit(f"{tag}: the job failed with exit codes {rcs} (see {out})")
    loads.append({"job": tag, "before": round(load0, 2), "after": round(os.getloadavg()[0], 2),
                  "wall_s": round(time.perf_counter() - t0, 1)})
    result = json.loads((out / f"phases_{tag}.json").read_text())
    if mode == "default":  # the runtime's own account of its choices
        events = read_events(out / f"run_{tag}" / "events.jsonl")
        result["auto_events"] = [e for e in events if e.get("event") == Event.AUTO_INTERVAL
                                 and e.get("rank") == 0]
    return result


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def whole_intervals(times: list[float], snaps: list[bool]) -> list[float]:
    """The steps after the first snapshot up to and including the last one: whole
    intervals only, so each snapshot's cost is counted once and in full."""
    idx = [i for i, s in enumerate(snaps) if s]
    if len(idx) < 2:
        return times
    return times[idx[0] + 1: idx[-1] + 1]


def interval_step_s(times: list[float], snaps: list[bool]) -> float:
    """The median over whole intervals of each interval's mean step time: one snapshot's
    cost is in every interval, and a stall from elsewhere on a shared host (another
    job's burst) moves one interval, not the figure."""
    idx = [i for i, s in enumerate(snaps) if s]
    if len(idx) < 2:
        return mean(times)
    return median([mean(times[a + 1: b + 1]) for a, b in pairwise(idx)])


def overheads(plain: dict, runs: dict[str, dict]) -> dict:
    """``overhead_<mode>_<phase>_<kind>`` for every phase the runtime jobs ran."""
    out: dict = {}
    ref = plain_refs(plain)
    for mode, res in runs.items():
        for p in res["phases"]:
            if p["name"].startswith("dcp_") or p["name"] == "warmup":
                continue
            step = mean(p["times"])  # the default job's: every step, the probe's too
            out[f"{mode}_{p['name']}"] = step / ref[p["name"].split("_", 1)[1]] - 1
    return out


def plain_refs(plain: dict) -> dict[str, float]:
    """Plain training's mean step time per rate: every plain phase of that rate (they
    run the same steps; the intervals mean nothing without the runtime), so noise
    between phases averages out instead of landing on one point."""
    by_rate: dict[str, list[float]] = {}
    for p in plain["phases"]:
        if p["name"].startswith("dcp_") or p["name"] == "warmup":
            continue
        by_rate.setdefault(p["name"].split("_", 1)[1], []).extend(p["times"])
    return {rate: mean(ts) for rate, ts in by_rate.items()}


def default_figures(job: dict, kind: str, ref: float) -> dict:
    """The default job's figures (see the module docstring), ``ref``: plain's mean step
    at the same rate."""
    ph = next(p for p in job["phases"] if p["name"] == f"default_{KEY_RATE}")
    chosen = job.get("auto_events", [])
    times, snaps = ph["times"][AUTO_WARM:], ph["snaps"][AUTO_WARM:]
    steady = interval_step_s(times, snaps)
    out = {f"overhead_plain_default_{kind}": mean(ph["times"]) / ref - 1,
           f"overhead_plain_default_steady_{kind}": steady / ref - 1,
           f"default_interval_steps_{kind}": ph.get("auto_every"),
           f"default_intervals_timed_{kind}": max(0, sum(snaps) - 1),
           f"default_steps_{kind}": len(ph["times"]),
           f"default_reasons_{kind}": [f"step {e['step']}: every {e['every_n_steps']} steps: "
                                       + "; ".join(e.get("reasons", [])) for e in chosen
                                       if e.get("tier", "replication") == "replication"],
           "auto_budget": AUTO_BUDGET}
    own = [t for t, s, prev in zip(times, snaps, [True, *snaps[:-1]]) if not s and not prev]
    if own:  # the same job's steps without a snapshot: the runtime's own reference
        out[f"overhead_default_{kind}_same_run"] = steady / median(own) - 1
    return out


def profile_of(phase: dict, plain_step_s: float) -> dict:
    """Per-snapshot breakdown (ms) of a k=2 phase (see the module docstring)."""
    prof = phase.get("profile") or {}
    n = max(1, sum(phase["snaps"]))
    added = (mean(phase["times"]) - plain_step_s) * len(phase["times"]) / n

    def per(key: str) -> float:
        return 1e3 * prof.get(key, 0.0) / n

    loop_stall = per("capture_s") + per("loop_wait_s") + 1e3 * phase.get("fence_wait_s", 0) / n
    exch, ann, recv = per("exchange_s"), per("announce_s"), per("receive_verify_s")
    return {
        "added_ms": 1e3 * added,
        "loop_stall_ms": loop_stall,
        "loop_capture_ms": per("capture_s"),
        "loop_wait_prev_round_ms": per("loop_wait_s"),
        "loop_fence_ms": 1e3 * phase.get("fence_wait_s", 0) / n,
        "round_seal_copy_hash_ms": per("seal_s"),
        "round_announce_ms": ann,
        "round_receive_verify_ms": recv,
        "round_receive_hash_ms": per("receive_hash_s"),
        "round_receive_wait_ms": max(0.0, recv - per("receive_hash_s")),
        "round_send_rest_ms": max(0.0, exch - ann - recv),
        "round_commit_ms": per("commit_s"),
        # cpu steps: the round's CPU time taken from the step (thread contention). Device
        # steps: negative when stalls hide behind the device's time (a fence wait does).
        "added_minus_loop_stall_ms": 1e3 * added - loop_stall,
    }


def snapshot_cost_for_model(result: dict, kind: str, every_n: int) -> float:
    """A k=2 snapshot's added time for the goodput model: the every-N phase's wall-time
    difference, but never below what was measured directly: the loop's capture stall
    per snapshot, and on cpu steps the added CPU time (less sensitive to other load on
    the host, which can make a wall-time difference read low or even negative)."""
    floor = 1e-3 * result[f"profile_k2_every1_{kind}"]["loop_capture_ms"]
    cpu_key = "cputime_overhead_k2_everyN_cpu"
    if kind == "cpu" and cpu_key in result:
        floor = max(floor, result[cpu_key] * result[f"plain_step_s_cpu_{KEY_RATE}"] * every_n)
    return max(result[f"k2_snapshot_cost_s_{kind}"], floor)


def recovery_inputs() -> dict:
    """In-process recovery and torchrun full restart, from bench_recovery's latest
    figures (same host; its own job and state size). The restart's own lost work (the
    steps since its newest DCP checkpoint, redone) is taken out: the model adds lost
    work itself."""
    latest = REPO / "benchmarks" / "results" / "latest.json"
    r = json.loads(latest.read_text()).get("bench_recovery", {}) if latest.exists() else {}
    if "full_restart_s" not in r:
        raise SystemExit("bench_overhead: run bench_recovery first (its restart and "
                         "recovery times feed the goodput model)")
    k, every, t = r["kill_step"], r["dcp_every_n_steps"], r["step_time_before_s"]
    redo = (k - (k - 1) // every * every) * t  # steps from the newest checkpoint to the kill
    return {"cl_recovery_s": r["recovery_s"], "dcp_restart_s": r["full_restart_s"] - redo,
            "source": "bench_recovery in benchmarks/results/latest.json "
                      f"(quick={r.get('quick')}, state {r.get('state_bytes')} bytes)",
            "dcp_restart_measured_s": r["full_restart_s"], "dcp_restart_redo_s": redo}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 rates, short phases, < 2 min")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=0, help="state = 12 x width^2 x layers")
    ap.add_argument("--every-n", type=int, default=8)
    ap.add_argument("--dcp-every", type=int, default=8)
    ap.add_argument("--kinds", default="cpu,device")
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--plot", default="", help="write the goodput figure (PNG) here")
    ap.add_argument("--job-timeout-s", type=float, default=300)
    args = ap.parse_args(argv)
    q = args.quick
    args.layers = args.layers or (2 if q else 8)
    rates = QUICK_RATES if q else RATES
    cpu_rates = (KEY_RATE,) if q else RATES  # cpu steps at 0.05 GB/s take seconds each
    state_bytes = 12 * args.width * args.width * args.layers
    kinds = args.kinds.split(",")
    t_start = time.perf_counter()
    progress(f"bench_overhead: state {state_bytes / 2**20:.0f} MiB per rank, rates {rates} "
             f"GB/s, kinds {kinds}, load {os.getloadavg()[0]:.2f}")
    batches = {}
    if "cpu" in kinds:
        batches = calibrate_cpu(args.width, args.layers,
                                {str(r): state_bytes / (r * 1e9) for r in cpu_rates})
        progress(f"cpu batches per rate: {batches}")
    loads: list[dict] = []
    result: dict = {"quick": q, "state_bytes": state_bytes, "rates_gbps": list(rates),
                    "every_n": args.every_n, "dcp_every": args.dcp_every}
    per_kind: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in kinds:
            phases = phases_for(kind, state_bytes, cpu_rates if kind == "cpu" else rates,
                                args.every_n, batches, q, args.dcp_every)
            res = {}
            # The default job between two plain ones: its figure is the smallest (a 2 %
            # budget), so the host's drift over the minutes it runs would weigh most on
            # it; the plain job after it runs the reference rate's phases again, and the
            # reference is the mean of both (a linear drift cancels).
            for mode in ("plain", "default", PLAIN_AFTER, "k1", "k2"):
                mine = [p for p in phases if runs_phase(mode, p["name"])]
                progress(f"{kind}: {mode} ({len(mine)} phases)")
                out = Path(tmp) / f"{mode}_{kind}"
                out.mkdir()
                res[mode] = run_job(mode, kind, out, mine, args, loads)
            per_kind[kind] = res
    result["load_avg_1m"] = loads
    result["load_avg_1m_max"] = max(max(x["before"], x["after"]) for x in loads)

    for kind, res in per_kind.items():
        plain = {p["name"]: p for p in res["plain"]["phases"]}
        ovh = overheads(res["plain"], {m: res[m] for m in ("k1", "k2", "default") if m in res})
        for key, v in ovh.items():
            mode, rest = key.split("_", 1)
            every, rate = rest.split("_")
            result[f"overhead_{mode}_{every}_{kind}_{rate}"] = v
        refs = plain_refs(res["plain"])
        for rate in (cpu_rates if kind == "cpu" else rates):
            result[f"rate_gbps_{kind}_{rate}"] = state_bytes / refs[str(rate)] / 1e9
            result[f"plain_step_s_{kind}_{rate}"] = refs[str(rate)]
        key_plain = refs[str(KEY_RATE)]
        result[f"overhead_plain_k2_every1_{kind}"] = ovh[f"k2_every1_{KEY_RATE}"]
        result[f"overhead_plain_k1_every1_{kind}"] = ovh[f"k1_every1_{KEY_RATE}"]
        result[f"overhead_plain_k2_everyN_{kind}"] = ovh[f"k2_everyN_{KEY_RATE}"]
        result[f"overhead_plain_k2_nosnap_{kind}"] = ovh[f"k2_nosnap_{KEY_RATE}"]
        if kind == "cpu":  # CPU seconds per step (rank 0's process, all its threads)
            per_step = {m: {p["name"]: p["cpu_s"] / len(p["times"]) for p in res[m]["phases"]
                            if "cpu_s" in p and p["times"]} for m in ("plain", "k1", "k2")}
            for m in ("k1", "k2"):
                for name in ("every1", "everyN"):
                    ph = f"{name}_{KEY_RATE}"
                    if ph in per_step[m] and ph in per_step["plain"]:
                        result[f"cputime_overhead_{m}_{name}_cpu"] = (
                            per_step[m][ph] / per_step["plain"][ph] - 1)
        k2 = {p["name"]: p for p in res["k2"]["phases"]}
        result[f"profile_k2_every1_{kind}"] = profile_of(k2[f"every1_{KEY_RATE}"], key_plain)
        # torchrun + DCP async_save every dcp_every steps, against the same plain steps
        dcp_ph = plain[f"dcp_{KEY_RATE}"]
        result[f"dcp_save_cost_s_{kind}"] = (mean(dcp_ph["times"]) - key_plain) * args.dcp_every
        result[f"k2_snapshot_cost_s_{kind}"] = ovh[f"k2_everyN_{KEY_RATE}"] * key_plain * \
            args.every_n
        after = plain_refs(res[PLAIN_AFTER])[str(KEY_RATE)]
        result[f"plain_step_s_{kind}_{KEY_RATE}_after_default"] = after
        result[f"plain_drift_{kind}"] = after / key_plain - 1
        result.update(default_figures(res["default"], kind, ref=(key_plain + after) / 2))

    # -- where it pays: the goodput model, fed with this run's figures, per kind --------
    rec = recovery_inputs()
    for kind in per_kind:
        prof = result[f"profile_k2_every1_{kind}"]
        m = goodput_model.Measured(
            step_s=result[f"plain_step_s_{kind}_{KEY_RATE}"],
            cl_snapshot_cost_s=snapshot_cost_for_model(result, kind, args.every_n),
            cl_round_s=1e-3 * (prof["round_seal_copy_hash_ms"] + prof["round_announce_ms"]
                               + prof["round_receive_verify_ms"] + prof["round_send_rest_ms"]
                               + prof["round_commit_ms"]),
            cl_recovery_s=rec["cl_recovery_s"],
            dcp_save_cost_s=max(result[f"dcp_save_cost_s_{kind}"], 1e-6),
            dcp_restart_s=rec["dcp_restart_s"],
        )
        sfx = "" if kind == "device" else f"_{kind}"
        result[f"goodput_model_inputs{sfx}"] = dict(m.__dict__)
        result[f"crossover_mtbf_s{sfx}"] = goodput_model.crossover_mtbf_s(m)
        result[f"goodput_ratio_at_mtbf_3h{sfx}"] = goodput_model.ratio_at(m, 3 * HOUR)
        # how much the runtime's MTBF estimate matters (ADR 0032), and the old default
        # (no MTBF at all: the budget's shortest interval whatever the failure rate)
        for label, f in (("estimate_x0.5", 0.5), ("estimate_x2", 2.0), ("budget_only", None)):
            off = goodput_model.Measured(**{**m.__dict__, "cl_mtbf_factor": f})
            result[f"goodput_ratio_at_mtbf_3h_{label}{sfx}"] = goodput_model.ratio_at(
                off, 3 * HOUR)
        result[f"goodput_curve{sfx}"] = {
            label: {"checkpointless": round(goodput_model.checkpointless(m, s)[0], 5),
                    "dcp": round(goodput_model.dcp(m, s)[0], 5),
                    "cl_every_n": goodput_model.checkpointless(m, s)[1],
                    "dcp_interval_s": round(goodput_model.dcp(m, s)[1], 2)}
            for label, s in (("1min", 60), ("10min", 600), ("1h", HOUR), ("3h", 3 * HOUR),
                             ("24h", 24 * HOUR))}
        for label, row in result[f"goodput_curve{sfx}"].items():
            progress(f"goodput at MTBF {label:>5} ({kind} step): checkpointless "
                     f"{row['checkpointless']:.4f} (every {row['cl_every_n']} steps), torchrun + "
                     f"DCP {row['dcp']:.4f} (every {row['dcp_interval_s']:.0f} s)")
        cross = result[f"crossover_mtbf_s{sfx}"]
        progress(f"crossover ({kind}): "
                 f"{'none in 1 min - 24 h' if cross is None else f'{cross / HOUR:.2f} h'}")
        if args.plot and kind == "device":
            goodput_model.plot(m, args.plot, f"{state_bytes / 2**20:.0f} MiB/rank, {KEY_RATE} "
                               "GB/s per rank, device-emulated step, k=2; measured on a 2-core "
                               "host")
    result["goodput_recovery_source"] = rec
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    emit({k: (round(v, 6) if isinstance(v, float) else v) for k, v in result.items()})


if __name__ == "__main__":
    main()
