"""The chaos soak: reference run, seeded schedule, chaos run, torchrun baseline, figures.

The whole procedure and every figure is defined in ``benchmarks/bench_goodput.py``'s
docstring; this module does it. :func:`add_arguments` and :func:`run` are shared by
``python -m benchmarks.bench_goodput`` and ``checkpointless chaos``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.chaos import metrics, procs
from launcher.chaos.runs import JobSpec, RunResult, run_checkpointless, run_torchrun
from launcher.chaos.schedule import Schedule, Topology, describe, generate, parse_mix
from recovery.common.events import Event
from replication.errors import CheckpointlessError

#: The fields of final_rank<r>.json that must equal the failure-free run's.
FINAL_FIELDS = ("step", "digest", "data_order", "position")

QUICK = {"steps": 240, "mtbf_s": 3.0, "min_failures": 3, "time_limit_s": 300.0}
FULL = {"steps": 1000, "mtbf_s": 1.25, "min_failures": 50, "time_limit_s": 1200.0}
#: Time kept back for the runs after the chaos run when the budget is split.
DCP_SAVE_S_GUESS = 0.08  # one synchronous DCP save of the default model on 2 cores


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true",
                    help="a few failures in under 2 minutes: {steps} steps, MTBF {mtbf_s} s, "
                         "at least {min_failures} faults".format(**QUICK))
    ap.add_argument("--seed", type=int, default=0, help="seed of the failure schedule")
    ap.add_argument("--mtbf-s", type=float, default=None,
                    help="mean time between failures, seconds of failure-free training "
                         f"(default {FULL['mtbf_s']}, quick {QUICK['mtbf_s']})")
    ap.add_argument("--steps", type=int, default=None, help="training steps")
    ap.add_argument("--min-failures", type=int, default=None,
                    help="place extra incidents until at least this many faults")
    ap.add_argument("--time-limit-s", type=float, default=None,
                    help="hard wall-clock limit of the whole benchmark")
    ap.add_argument("--mix", default="",
                    help="incident weights KIND=W,... over the default mix (kinds: sigkill, "
                         "sigstop, exception, node, simultaneous, during_recovery, storage, "
                         "total_loss)")
    ap.add_argument("--dcp-every", type=int, default=0,
                    help="baseline checkpoint interval in steps (0: Young's optimum for "
                         "the MTBF and an estimated save time)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the torchrun baseline")
    ap.add_argument("--out", default="", help="keep run directories here (default: a "
                                              "temporary directory, removed at the end)")
    ap.add_argument("--schedule-file", default="",
                    help="replay a schedule saved by an earlier run (schedule.json)")
    ap.add_argument("--heartbeat-timeout-s", type=float, default=5.0,
                    help="worker and agent heartbeat timeout (hang and node-loss "
                         "detection; also the baseline's collective timeout)")
    ap.add_argument("--dim", type=int, default=64, help="model width (small GPT)")
    ap.add_argument("--layers", type=int, default=2, help="model depth")


@dataclass
class Options:
    quick: bool = False
    seed: int = 0
    mtbf_s: float = FULL["mtbf_s"]
    steps: int = int(FULL["steps"])
    min_failures: int = int(FULL["min_failures"])
    time_limit_s: float = FULL["time_limit_s"]
    mix: str = ""
    dcp_every: int = 0
    baseline: bool = True
    out: str = ""
    schedule_file: str = ""
    dim: int = 64
    layers: int = 2
    heartbeat_timeout_s: float = 5.0

    @staticmethod
    def from_args(ns: argparse.Namespace) -> Options:
        base = QUICK if ns.quick else FULL

        def pick(name: str) -> Any:
            value = getattr(ns, name)
            return base[name] if value is None else value

        return Options(quick=ns.quick, seed=ns.seed, mtbf_s=float(pick("mtbf_s")),
                       steps=int(pick("steps")), min_failures=int(pick("min_failures")),
                       time_limit_s=float(pick("time_limit_s")), mix=ns.mix,
                       dcp_every=ns.dcp_every, baseline=not ns.no_baseline, out=ns.out,
                       schedule_file=ns.schedule_file, dim=ns.dim, layers=ns.layers,
                       heartbeat_timeout_s=ns.heartbeat_timeout_s)


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] chaos: {msg}", file=sys.stderr, flush=True)


class BenchmarkError(CheckpointlessError, RuntimeError):
    pass


def _same_final(ref: RunResult, got: RunResult, world: int) -> tuple[bool, str]:
    if sorted(ref.finals) != list(range(world)):
        return False, "the failure-free reference run did not finish every rank"
    if sorted(got.finals) != list(range(world)):
        missing = sorted(set(range(world)) - set(got.finals))
        return False, (f"final state written by ranks {sorted(got.finals)} only; "
                       + "; ".join(_last_seen(got.events, r) for r in missing))
    for r in range(world):
        for key in FINAL_FIELDS:
            if got.finals[r].get(key) != ref.finals[r].get(key):
                return False, (f"rank {r}: {key} differs from the failure-free run "
                               f"({got.finals[r].get(key)!r} != {ref.finals[r].get(key)!r})")
    return True, ""


def _last_seen(events: list[dict], rank: int) -> str:
    """What the events say last about ``rank``'s processes (the evidence for a rank that
    wrote no final state: killed on its way out, fenced, never started)."""
    about = [e for e in events if e.get("rank") == rank and e.get("event") in (
        Event.WORKER_EXIT, Event.WORKER_HUNG, Event.WORKER_START, Event.FAULT_INJECTED)]
    if not about:
        return f"rank {rank}: no process event"
    tail = ", ".join(
        f"{e['event']}(" + " ".join(f"{k}={e[k]}" for k in ("node", "pid", "step", "exitcode",
                                                            "signal", "kind") if k in e) + ")"
        for e in about[-4:])
    return f"rank {rank} last: {tail}"


def _frontier(events: list[dict], started: float, stopped: float) -> tuple[int, float]:
    """(newest step rank 0 completed, seconds since the window opened) for a run cut
    short."""
    steps = metrics.step_events(events)
    done = max((int(e["step"]) for e in steps), default=0)
    return done, stopped - started


def _interrupt(signum: int, _frame: object) -> None:
    """SIGTERM ends the benchmark like Ctrl-C: the runners' ``finally`` kill everything."""
    raise KeyboardInterrupt(f"signal {signum}")


def run(opt: Options, log: Callable[[str], None] = progress) -> dict[str, Any]:
    """The whole benchmark; returns the result object (see bench_goodput's docstring)."""
    t_start = time.time()
    deadline = t_start + opt.time_limit_s
    procs.become_subreaper()
    root = Path(opt.out) if opt.out else Path(tempfile.mkdtemp(prefix="chaos_"))
    root.mkdir(parents=True, exist_ok=True)
    old_term = signal.signal(signal.SIGTERM, _interrupt)
    spec = JobSpec(steps=opt.steps, dim=opt.dim, layers=opt.layers,
                   heartbeat_timeout_s=opt.heartbeat_timeout_s)
    topo = Topology(nnodes=spec.nnodes, nproc=spec.nproc)
    result: dict[str, Any] = {"quick": opt.quick, "seed": opt.seed, "mtbf_s": opt.mtbf_s,
                              "steps": opt.steps, "world": f"{spec.nnodes}x{spec.nproc}"}
    try:
        result.update(_run(opt, spec, topo, root, deadline, log))
    except BenchmarkError as exc:
        result["error"] = str(exc)
    finally:
        signal.signal(signal.SIGTERM, old_term)
        trouble = ("error" in result or "stopped_reason" in result
                   or result.get("bit_identical") is False)
        if not opt.out and not trouble:
            shutil.rmtree(root, ignore_errors=True)
        elif not opt.out:
            result["kept_run_dir"] = str(root)  # the evidence: events, logs, schedule.json
    result["wall_s"] = round(time.time() - t_start, 1)
    result["time_limit_s"] = opt.time_limit_s
    if opt.out or "kept_run_dir" in result:
        (root / "result.json").write_text(json.dumps(result, indent=1, sort_keys=True))
    return result


def _run(opt: Options, spec: JobSpec, topo: Topology, root: Path, deadline: float,
         log: Callable[[str], None]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # 1. failure-free reference: the digests to match and the productive step time
    log(f"failure-free reference: {spec.nnodes} nodes x {spec.nproc} workers + a spare "
        f"node, {spec.steps} steps")
    ref = run_checkpointless(spec, root / "reference", deadline=deadline, log=log)
    _check_complete(ref, spec, "the failure-free reference run")
    t_ff = metrics.window_s(ref.events, spec.steps, spec.warmup_steps)
    step_s = t_ff / spec.window_steps
    out.update(window_ff_s=round(t_ff, 3), t_step_s=round(step_s, 5),
               load_avg={"cpus": os.cpu_count(), "reference": ref.load_avg})
    # 2. the schedule
    if opt.schedule_file:
        from launcher.chaos.schedule import from_json

        sched = from_json(json.loads(Path(opt.schedule_file).read_text()))
        if sched.steps != spec.steps:
            raise BenchmarkError(f"--schedule-file is for {sched.steps} steps, not {spec.steps}")
        early = [f for f in sched.faults if f.step <= spec.warmup_steps]
        if early:
            raise BenchmarkError(f"--schedule-file: fault at step {early[0].step} falls in the "
                                 f"{spec.warmup_steps}-step warm-up, before the measured window")
    else:
        sched = generate(seed=opt.seed, mtbf_s=opt.mtbf_s, step_s=step_s, steps=spec.steps,
                         topology=topo, mix=parse_mix(opt.mix),
                         min_failures=opt.min_failures, warmup_steps=spec.warmup_steps + 1)
    (root / "schedule.json").write_text(json.dumps(sched.to_json(), indent=1))
    log(f"schedule (seed {opt.seed}, {len(sched.faults)} faults in {sched.incidents} "
        f"incidents):\n{describe(sched.faults)}")
    out["failures_scheduled"] = len(sched.faults)
    out["schedule_spec"] = sched.runtime_spec()
    out["storage_outages_scheduled"] = [[f.step, f.duration_s] for f in sched.storage_outages]
    # 3. the chaos run
    log("chaos run")
    chaos = run_checkpointless(spec, root / "chaos", deadline=deadline, log=log,
                               faults=sched.runtime_spec(), outages=sched.storage_outages,
                               node_losses=sched.node_losses)
    out["load_avg"]["chaos"] = chaos.load_avg
    out.update(_chaos_figures(spec, sched, ref, chaos, t_ff))
    # 4. the torchrun + DCP baseline, failure-free then with the same schedule
    if opt.baseline and time.time() < deadline:
        out.update(_baseline(opt, spec, sched, root, deadline, step_s, ref, log))
        if out.get("baseline_goodput"):
            out["goodput_over_baseline"] = out["goodput"] / out["baseline_goodput"]
            if out.get("baseline_window_s") and out.get("window_s"):
                out["baseline_wall_over_wall"] = out["baseline_window_s"] / out["window_s"]
    out["load_avg"].update(out.pop("_baseline_load", {}))
    out["leftover_processes"] = [*ref.leftovers, *chaos.leftovers,
                                 *out.pop("_baseline_leftovers", [])]
    return out


def _check_complete(run: RunResult, spec: JobSpec, what: str) -> None:
    if run.timed_out:
        raise BenchmarkError(f"{what} did not finish before the time limit")
    if sorted(run.finals) != list(range(spec.world)):
        reasons = "; ".join(run.failed_reasons) or f"exit codes {run.returncodes}"
        raise BenchmarkError(f"{what} failed: {reasons} (see {run.run_dir})")


def _chaos_figures(spec: JobSpec, sched: Schedule, ref: RunResult, chaos: RunResult,
                   t_ff: float) -> dict[str, Any]:
    ev = chaos.events
    fired = [e for e in ev if e.get("event") == Event.FAULT_INJECTED]
    by_kind = Counter(str(e.get("kind")) for e in fired)
    if chaos.outages:
        by_kind["storage"] = len(chaos.outages)
    rec_gens = {int(e["gen"]) for e in ev if e.get("event") == Event.RECOVERY}
    fallback_gens = {e.get("gen") for e in ev if e.get("event") == Event.DURABLE_FALLBACK}
    incs = metrics.incidents(ev, step_s=t_ff / spec.window_steps)
    same, why = _same_final(ref, chaos, spec.world)
    out: dict[str, Any] = {
        "failures_injected": len(fired) + len(chaos.outages),
        "failures_by_kind": dict(sorted(by_kind.items())),
        "faults_not_fired": sorted(set(f.spec for f in sched.process_faults)
                                   - {str(e.get("fault")) for e in fired}),
        "incidents": len(incs),
        "unplanned_recoveries": sum(not i.planned for i in incs),
        "recoveries_in_process": len(rec_gens - fallback_gens),
        "fallbacks_to_durable": metrics.count_fallbacks(ev),
        "false_losses": metrics.false_losses(ev),
        "bit_identical": same,
        "spare_nodes_started": chaos.restarts,
        "max_threads_per_process": {"reference": ref.max_threads, "chaos": chaos.max_threads},
        "storage_outages": chaos.outages,
    }
    if not same:
        out["not_identical_because"] = why
    stopped = [r for r in chaos.failed_reasons if r]
    if chaos.timed_out:
        stopped.append("the chaos run did not finish before the time limit")
    if stopped:
        out["stopped_reason"] = "; ".join(dict.fromkeys(stopped))
        out["faults_unresolved"] = [str(e.get("fault")) for e in metrics.unresolved_faults(ev)]
        lost = [f for f in sched.faults if f.role == "total_loss"]
        if lost:
            out["stopped_by_design"] = (
                f"incident at step {lost[0].step} killed rank {lost[0].rank} and every holder "
                f"of its replicas ({', '.join(str(f.rank) for f in lost[1:])}) at once: no "
                "in-memory copy of its state survived")
    try:
        t_chaos = metrics.window_s(ev, spec.steps, spec.warmup_steps)
    except metrics.MetricsError as exc:
        out["goodput"] = 0.0
        out["goodput_error"] = str(exc)
        return out
    total = sum(i.cost_s for i in incs)
    gp = metrics.goodput(t_ff, t_chaos)
    bound = metrics.goodput_bound(total, t_chaos)
    parts = metrics.breakdown(incs)
    # The same figure with the productive step time taken from this run's own median
    # step: insensitive to a change of background load between the two runs.
    gp_same = spec.window_steps * metrics.median_step_s(ev) / t_chaos
    out.update(
        window_s=round(t_chaos, 3),
        goodput=gp,
        goodput_same_run=gp_same,
        goodput_same_run_over_bound=gp_same / bound if bound > 0 else 0.0,
        t_step_median_s={"reference": round(metrics.median_step_s(ref.events), 5),
                         "chaos": round(metrics.median_step_s(ev), 5)},
        goodput_bound=bound,
        goodput_over_bound=gp / bound if bound > 0 else 0.0,
        mtbf_realized_s=t_chaos / len(incs) if incs else None,
        cost_per_incident_s=total / len(incs) if incs else 0.0,
        **{k: round(v, 4) for k, v in parts.items()},
        incident_log=[i.summary() for i in incs],
        durable=_durable_state(chaos, spec),
    )
    return out


def _durable_state(chaos: RunResult, spec: JobSpec) -> dict[str, Any]:
    """The durable tier after the run: its newest valid checkpoint, re-verified, and
    whether persistence resumed after the last storage outage (``None`` when no save
    was due between the end of that outage and the end of training)."""
    from replication.durable import list_checkpoints, verify

    path = str(chaos.run_dir / "durable")
    ckpts = list_checkpoints(path)
    if not ckpts:
        return {"newest_step": None, "verified": False}
    newest = ckpts[-1]
    out: dict[str, Any] = {"newest_step": newest.step, "verified": bool(verify(newest).ok),
                           "steps": [c.step for c in ckpts]}
    if chaos.outages:
        end = max(o["to_step"] for o in chaos.outages)
        due = [s for s in range(spec.persist_every, spec.steps + 1, spec.persist_every)
               if s > end]
        out["resumed_after_outages"] = newest.step > end if due else None
    return out


def _baseline(opt: Options, spec: JobSpec, sched: Schedule, root: Path, deadline: float,
              step_s: float, ref: RunResult, log: Callable[[str], None]) -> dict[str, Any]:
    every = opt.dcp_every or max(1, round(
        metrics.young_interval_s(DCP_SAVE_S_GUESS, opt.mtbf_s) / step_s))
    out: dict[str, Any] = {"dcp_every": every}
    log(f"baseline: torchrun, DCP checkpoint every {every} steps, failure-free")
    base_ff = run_torchrun(spec, root / "baseline_reference", deadline=deadline, ckpt_every=every,
                           log=log)
    leftovers = list(base_ff.leftovers)
    out["_baseline_leftovers"] = leftovers
    out["_baseline_load"] = {"baseline_reference": base_ff.load_avg}
    if not base_ff.finals or len(base_ff.finals) != spec.world:
        out["baseline_error"] = "the failure-free torchrun run did not finish"
        return out
    t_ff_b = metrics.window_s(base_ff.events, spec.steps, spec.warmup_steps)
    step_b = t_ff_b / spec.window_steps
    saves = [float(e["save_s"]) for e in base_ff.events
             if e.get("event") == Event.SAVED and e.get("rank") == 0]
    save_s = metrics.mean(saves)
    out.update(baseline_window_ff_s=round(t_ff_b, 3),
               baseline_t_step_s=round(step_b, 5),
               baseline_save_s=round(save_s, 4),
               dcp_every_young=max(1, round(metrics.young_interval_s(save_s, opt.mtbf_s)
                                            / step_b)),
               steady_overhead=step_s / step_b - 1.0,
               baseline_reference_identical=_same_final(ref, base_ff, spec.world)[0])
    worker_faults = sum(f.kind != "node" for f in sched.process_faults)
    log("baseline with the same schedule")
    base = run_torchrun(spec, root / "baseline", deadline=deadline, faults=sched.runtime_spec(),
                        outages=sched.storage_outages, ckpt_every=every,
                        max_restarts=worker_faults + 5,
                        max_scheduler_restarts=sched.node_losses + 3, log=log)
    leftovers += base.leftovers
    out["_baseline_load"]["baseline"] = base.load_avg
    fired = [e for e in base.events if e.get("event") == Event.FAULT_INJECTED]
    restarts = sum(1 for e in base.events if e.get("event") == Event.START and e.get("rank") == 0)
    truncated = not (len(base.finals) == spec.world and not base.timed_out)
    out.update(baseline_failures_injected=len(fired) + len(base.outages),
               baseline_restarts=max(0, restarts - 1),
               baseline_scheduler_restarts=base.restarts,
               baseline_truncated=truncated,
               # Against torchrun's own failure-free run: its gloo ring all-reduce sums in
               # another order than the runtime's rank-ordered one (ADR 0015), so its
               # floats need not match our reference even when it recovers exactly.
               baseline_bit_identical=None if truncated
               else _same_final(base_ff, base, spec.world)[0])
    steps = metrics.step_events(base.events)
    firsts = [float(e["ts"]) for e in steps if int(e["step"]) == spec.warmup_steps]
    if not firsts:
        out["baseline_error"] = (f"the torchrun baseline never completed step "
                                 f"{spec.warmup_steps}")
        return out
    if out["baseline_truncated"]:
        stop = max(float(e["ts"]) for e in base.events)
        done, span = _frontier(base.events, min(firsts), stop)
        out.update(baseline_steps_done=done, baseline_window_s=round(span, 3),
                   baseline_goodput=(done - spec.warmup_steps) * step_b / span
                   if span > 0 else 0.0)
        if base.failed_reasons:
            out["baseline_stopped_reason"] = "; ".join(base.failed_reasons)
    else:
        t_b = metrics.window_s(base.events, spec.steps, spec.warmup_steps)
        out.update(baseline_window_s=round(t_b, 3), baseline_goodput=metrics.goodput(t_ff_b, t_b))
    return out
