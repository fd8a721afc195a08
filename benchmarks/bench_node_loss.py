"""Node loss with the job store in node 0's agent (c10d) and in etcd, side by side.

One 2-node x 2-worker job (``tests/workers`` training script of the recovery tests,
replication factor 2) with a spare node, run several ways in one invocation:

- ``node_loss_recovery_s_c10d``: node 1 (agent and workers) SIGKILLed at step 8 under
  the default c10d store; from the kill to the first step every rank completed after
  the recovery (the ``resumed`` events);
- ``node_loss_recovery_s_etcd``: the same under ``--rdzv-backend etcd`` on a 3-member
  etcd cluster on loopback; ``node_loss_detect_s``: its detection part (kill to the
  first ``node_lost``);
- ``node0_loss_recovered`` / ``node0_loss_bit_identical``: node 0 killed under etcd (under
  c10d this ends the job: node 0 hosts the store); bit-identical against a failure-free
  run under etcd (``--quick``: against the c10d node-1 run, itself a recovered run that
  the test suite checks against a failure-free one);
- ``partition_recovery_s``: under etcd with every node in its own network namespace and
  etcd in another, node 1's link cut (its processes keep running); from the cut to the
  first step after the recovery. Needs root; ``null`` with a reason otherwise.
- ``slurm_node_loss_recovery_s``: the c10d run's loss (node 1's agent and workers
  SIGKILLed at step 8) in a job submitted to a real Slurm cluster through
  ``examples/slurm/train.sbatch`` (slurmctld and one slurmd per network namespace,
  ``tests/slurm_cluster.py``); Slurm sees the node's task die and must keep the step.
  ``slurm_over_plain_node_loss`` is its ratio to ``node_loss_recovery_s_c10d``, and
  ``slurm_node_loss_bit_identical`` compares it with a failure-free run under the same
  Slurm (``--quick``: with the c10d run). Needs root and Slurm; ``null`` otherwise.

Every run at the default liveness settings (``recovery.heartbeat_timeout_s`` 15 s,
interval 1 s), as a user gets them: a killed node is declared lost from its agent's
closed connections (``launcher/peer_link.py``, about two intervals), a partitioned one
closes nothing and is judged by the timeout. ``node_loss_recovery_s`` is the c10d
figure. What it does not capture: etcd on its own
machines (here it shares the 2 cores with the job), real network latency, a loaded
host's false losses. Prints a JSON object as its last line.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._harness import emit, progress
from recovery.common.events import Event
from tests.etcd_cluster import EtcdCluster, etcd_missing_reason
from tests.recovery_harness import FINAL_FIELDS, JobResult, run_job

FAST: tuple[str, ...] = ()  # the defaults (the heartbeat settings are read back below)


def _recovery_figures(job: JobResult, t_fail: float | None = None) -> dict[str, Any]:
    """Failure (the injected fault, or ``t_fail``) to the last rank's first step after
    the newest recovery, and to the first node_lost."""
    if t_fail is None:
        faults = job.events(Event.FAULT_INJECTED)
        t_fail = min(float(e["ts"]) for e in faults) if faults else None
    recs = job.events(Event.RECOVERY)
    resumed = job.events(Event.RESUMED)
    lost = job.events(Event.NODE_LOST)
    if t_fail is None or not recs or not resumed:
        return {"recovered": False}
    gen = max(e["gen"] for e in recs)
    first_steps = [float(e["ts"]) for e in resumed if e.get("gen") == gen]
    return {
        "recovered": not job.timed_out and bool(first_steps),
        "recovery_s": round(max(first_steps) - t_fail, 3) if first_steps else None,
        "detect_s": round(min(float(e["ts"]) for e in lost) - t_fail, 3) if lost else None,
    }


def _same_final(a: JobResult, b: JobResult) -> bool:
    fa, fb = a.finals(), b.finals()
    return bool(fa) and sorted(fa) == sorted(fb) == list(range(a.world_size)) and all(
        fa[r][k] == fb[r][k] for r in fa for k in FINAL_FIELDS)


def _partition(tmp: Path) -> dict[str, Any]:
    from tests import netns
    from tests.lab_jobs import run_in_lab, wait_events

    why = netns.available()
    if why is not None:
        return {"partition_recovery_s": None, "partition_skipped": why}
    marks: dict[str, float] = {}

    def cut(run_dir: Path) -> None:
        wait_events(run_dir, lambda ev: any(e.get("event") == Event.STEP and e["step"] >= 3
                                            for e in ev), "step 3")
        marks["cut"] = time.time()
        lab.cut(1)
        wait_events(run_dir, lambda ev: any(e.get("event") == Event.RESUMED for e in ev
                                            if float(e["ts"]) > marks["cut"]), "a resumed step")
        lab.restore(1)

    with (netns.NetLab(4, tag="bench") as lab,
          EtcdCluster(1, host=lab.addr(3), launch_prefix=lab.prefix(3)) as cluster):
        job = run_in_lab(lab, tmp / "partition", nnodes=2, spare_nodes=1, timeout_s=150,
                         during=cut, etcd=",".join(cluster.endpoints), overrides=FAST)
    fig = _recovery_figures(job, marks.get("cut"))
    return {"partition_recovery_s": fig.get("recovery_s"),
            "partition_detect_s": fig.get("detect_s"),
            "partition_exit_codes": job.returncodes}


def _slurm(tmp: Path, plain: JobResult, quick: bool) -> dict[str, Any]:
    from tests import slurm_cluster

    why = slurm_cluster.available()
    if why is not None:
        return {"slurm_node_loss_recovery_s": None, "slurm_skipped": why}
    with slurm_cluster.SlurmCluster(tmp / "slurm", nodes=3).start() as cluster:
        info, job, _out = cluster.run_template(
            tmp / "slurm-loss", "recovery.fault=2:8:snapshot:node", *FAST, timeout_s=150)
        if quick:
            reference, what = plain, "the c10d node-1-loss run"
        else:
            progress("slurm: failure-free reference")
            _info, reference, _out = cluster.run_template(tmp / "slurm-ref", *FAST,
                                                          timeout_s=150)
            what = "a failure-free run under the same Slurm"
    fig = _recovery_figures(job)
    return {"slurm_node_loss_recovery_s": fig.get("recovery_s"),
            "slurm_node_loss_detect_s": fig.get("detect_s"),
            "slurm_job_state": f"{info.state} {info.exit_code}",
            "slurm_node_loss_bit_identical": _same_final(reference, job),
            "slurm_reference": what}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="no failure-free etcd reference run")
    args = ap.parse_args()
    t0 = time.monotonic()
    missing = etcd_missing_reason()
    if missing:
        raise SystemExit(f"bench_node_loss needs etcd: {missing}")
    from recovery.common.config import RecoveryConfig

    defaults = RecoveryConfig()
    out: dict[str, Any] = {"quick": args.quick,
                           "heartbeat_timeout_s": defaults.heartbeat_timeout_s,
                           "heartbeat_interval_s": defaults.heartbeat_interval_s}
    with tempfile.TemporaryDirectory(prefix="bench-node-loss-") as d:
        tmp = Path(d)
        progress("c10d: node 1 lost")
        c10d = run_job(tmp / "c10d", nnodes=2, spare_nodes=1, timeout_s=150,
                       overrides=["recovery.fault=2:8:snapshot:node", *FAST])
        fig = _recovery_figures(c10d)
        out["node_loss_recovery_s_c10d"] = fig.get("recovery_s")
        out["node_loss_recovery_s"] = fig.get("recovery_s")
        out["node_loss_detect_s_c10d"] = fig.get("detect_s")
        with EtcdCluster(3) as cluster:
            endpoints = ",".join(cluster.endpoints)
            progress("etcd: node 1 lost")
            etcd = run_job(tmp / "etcd", nnodes=2, spare_nodes=1, timeout_s=150, etcd=endpoints,
                           overrides=["recovery.fault=2:8:snapshot:node", *FAST])
            fig = _recovery_figures(etcd)
            out["node_loss_recovery_s_etcd"] = fig.get("recovery_s")
            out["node_loss_detect_s"] = fig.get("detect_s")
            progress("etcd: node 0 lost")
            node0 = run_job(tmp / "node0", nnodes=2, spare_nodes=1, timeout_s=150,
                            etcd=endpoints, overrides=["recovery.fault=0:8:snapshot:node", *FAST])
            fig0 = _recovery_figures(node0)
            out["node0_loss_recovered"] = bool(fig0.get("recovered"))
            out["node0_loss_recovery_s"] = fig0.get("recovery_s")
            if args.quick:
                reference, out["node0_reference"] = c10d, "the c10d node-1-loss run"
            else:
                progress("etcd: failure-free reference")
                reference = run_job(tmp / "reference", nnodes=2, timeout_s=150, etcd=endpoints)
                out["node0_reference"] = "a failure-free run under etcd"
            out["node0_loss_bit_identical"] = _same_final(reference, node0)
        progress("etcd in network namespaces: node 1's link cut")
        out.update(_partition(tmp))
        progress("slurm: node 1 lost")
        out.update(_slurm(tmp, c10d, args.quick))
    c, e = out.get("node_loss_recovery_s_c10d"), out.get("node_loss_recovery_s_etcd")
    out["etcd_over_c10d_node_loss"] = round(e / c, 3) if c and e else None
    s = out.get("slurm_node_loss_recovery_s")
    out["slurm_over_plain_node_loss"] = round(s / c, 3) if c and s else None
    out["wall_s"] = round(time.monotonic() - t0, 1)
    emit(out)


if __name__ == "__main__":
    main()
