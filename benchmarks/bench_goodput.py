"""Chaos soak: goodput under a seeded random failure schedule, against its bound and torchrun.

    python -m benchmarks.bench_goodput --quick            # a few failures, < 2 minutes
    python -m benchmarks.bench_goodput                    # >= 50 failures, <= 20 min
    checkpointless chaos --quick                           # the same, from the CLI

The job is ``launcher/chaos/workload.py`` (a small GPT, data parallel) on 2 nodes x 2
workers: two ``checkpointless run`` agents on this machine with one warm spare worker
each, a spare node (an agent with a warm spare per rank it may take over), replication
factor 2 (ring placement), the durable tier on (``persistence.every_n_steps=25``),
heartbeat timeout 5 s (``--heartbeat-timeout-s``). The benchmark runs, in order:

1. **reference**: the job without failures (same configuration, same steps).
2. **schedule**: incidents arrive as a Poisson process with mean gap ``--mtbf-s``
   seconds of failure-free training (the reference run's step time turns seconds into
   steps), seeded by ``--seed``. Each is a worker SIGKILL, a hang (SIGSTOP; the agent's
   heartbeat watchdog kills the worker), an exception on one rank, the loss of a node
   (its agent and every process on it; a spare node takes over and the benchmark starts
   a new spare node, as a scheduler would), two ranks at once, a second failure during
   the recovery from a first (on a survivor, sometimes taking its node), or a storage
   outage of the durable tier (the checkpoint path starts failing for a few seconds;
   training must go on). Faults fire at a phase of a step (start, forward, backward,
   optimizer step, snapshot, replication, recovery) through the runtime's fault hook
   (``recovery.fault=rank:step:phase:kind``). No incident loses every copy of a rank's
   state, nor node 0 (it hosts the job's store), unless ``--mix total_loss=W`` asks for
   it: the runtime then falls back to the newest durable checkpoint
   (``fallbacks_to_durable``), or the run stops and says why (``stopped_reason``,
   ``stopped_by_design``). See ``launcher/chaos/schedule.py``.
3. **chaos**: the same job with the schedule.
4. **baseline**: the same job under ``torchrun --standalone --max-restarts`` with a
   synchronous DCP checkpoint every N steps (``--dcp-every``; default Young's optimum
   ``sqrt(2 x save time x MTBF)``), failure-free, then with the same schedule. A
   failure restarts every worker, which resumes from the newest checkpoint; a node loss
   kills torchrun and the benchmark starts it again. ``workload.py`` says how each
   fault kind is played there (generously to the baseline).

Every process the benchmark starts carries a token in its environment; at the end of
each run all of them are killed by pid and the count of any still alive is reported
(``leftover_processes``, always ``[]``). ``--time-limit-s`` bounds the whole benchmark
(quick 300 s, full 1200 s); a baseline cut short by it is scored on the progress made.

Figures of the last stdout line (JSON; also ``result.json`` under ``--out``); "window" =
rank 0's first completion of the warm-up step (40; no failure before it) to its last
completion of the final step, so start-up and shutdown are left out alike:

- ``failures_injected``: faults that fired (``fault_injected`` events) + storage
  outages applied; ``failures_by_kind``; ``faults_not_fired`` (scheduled, never
  reached: a ``recovery``-phase fault whose rank was not a survivor of that step).
- ``incidents``: interruptions of training (faults that fired between two completed
  recoveries count once); ``unplanned_recoveries``: recoveries nobody injected a
  fault for (false hang detections, say).
- ``recoveries_in_process``: generations recovered in-process; ``fallbacks_to_durable``:
  recoveries from the durable tier (``durable_fallback`` events, one per generation).
- ``goodput`` = window of the reference / window of the chaos run: the productive step
  time (what the steps take when nothing fails) over wall time.
- ``goodput_bound`` = ``1 - (detect + recover + lost work) / MTBF`` with, per incident,
  detect = first fault -> first detection event, recover = detection -> the last rank's
  ``recovered_at`` in the ``recovery`` events, lost work = completion of the step
  recovered to -> the fault, averaged over incidents, and the realized
  ``MTBF = chaos window / incidents``. Equivalently ``1 - total measured cost / window``.
- ``goodput_over_bound``: near 1 when the measured parts explain all the lost time.
- ``baseline_goodput``: the same ratio for torchrun + DCP (its failure-free window over
  its chaos window); ``goodput_over_baseline`` = goodput / baseline_goodput;
  ``baseline_wall_over_wall``: the baseline's chaos window over ours (absolute, so it
  includes the steady-state cost of snapshots, ``steady_overhead``).
- ``bit_identical``: every rank's final model+optimizer digest, step, data order and
  data position equal the reference's (``not_identical_because`` otherwise);
  ``baseline_bit_identical``: the same check for the baseline's final state against the
  baseline's own failure-free run (``baseline_reference_identical``: against ours; with
  3+ ranks it is false because torchrun's gloo ring all-reduce sums in another order than
  the runtime's rank-ordered one, ADR 0015).
- ``detect_s``, ``recover_s``, ``lost_work_s``: means per incident;
  ``recovery_abort_s``, ``recovery_rendezvous_s``, ``recovery_transfer_s``: the worst
  rank's phase timings from the ``recovery`` events, mean per incident.
- ``goodput_same_run`` (``_over_bound``): the productive step time taken from the chaos
  run's own median step, immune to background load changing between runs.
- ``durable``: the newest durable checkpoint after the run, re-verified, and whether
  persistence resumed after the last storage outage (``null``: no save was due after it).
- ``load_avg``: mean 1-minute load average during each run (the machine may be shared);
  ``max_threads_per_process``: the most threads one process had (a leak shows here).
- ``stopped_reason`` / ``stopped_by_design``: why a chaos run ended early; it also
  stops when 25 recoveries in a row do not get training past its best step (a
  recovery loop), naming the failure each time.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks._harness import emit
from launcher.chaos.soak import Options, add_arguments, run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    try:
        result = run(Options.from_args(args))
    except KeyboardInterrupt:
        print("chaos: interrupted; every process it started was stopped", file=sys.stderr)
        return 130
    emit(result)
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    raise SystemExit(main())
