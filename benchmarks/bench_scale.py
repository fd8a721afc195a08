"""Scale harness: the control plane's real code with up to 1,024-2,048 simulated ranks,
and the model to 16,384.

    python -m benchmarks.bench_scale [--quick] [--write-docs]

Per N it measures the commit's latency (the tree over the side channel, in virtual time,
and the store count, in wall clock against a real TCPStore), store operations per step
per node, one agent's liveness check, and one node loss's rendezvous (time and store
operations); fits each growth law; calibrates the model (``benchmarks/scale_model.py``)
in the same run and predicts 1k, 4k and 16k ranks. Full mode (or ``--write-docs``)
rewrites the generated part of ``docs/scale.md`` and ``docs/img/scale.png``.
Progress goes to stderr; the last stdout line is the JSON result. How and why:
``docs/scale.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from typing import Any

from benchmarks import scale_model as M
from benchmarks import scale_sim as S
from benchmarks._harness import REPO, emit, progress

RANKS_PER_NODE = 8
FACTOR = 2
PREDICT_AT = (1024, 4096, 16384)
DOC = REPO / "docs" / "scale.md"
PLOT = REPO / "docs" / "img" / "scale.png"
BEGIN, END = "<!-- bench_scale:begin -->", "<!-- bench_scale:end -->"


def _ms(x: float) -> float:
    return round(1e3 * x, 4)


def _record_fn(store: Any) -> Any:
    """Rank 0's record, as ``Replicator._record_committed`` writes it."""
    from replication.replica_protocol.commit import COMMITTED_KEY
    from replication.side_channel import signing

    def record(step: int) -> None:
        store.set(COMMITTED_KEY, signing.seal(COMMITTED_KEY, str(step)))
        store.check([COMMITTED_KEY])

    return record


def measure(quick: bool) -> dict[str, Any]:
    from recovery.common.config import RecoveryConfig
    from replication.replica_protocol.commit_tree import depth_of
    from replication.side_channel import signing

    signing.install(signing.Signer(os.urandom(32)))  # sealed records need a job key
    tree_ns = [8, 16, 32, 64, 128, 256, 512, 1024] + ([] if quick else [2048])
    ledger_ns = [8, 64, 256, 1024] if quick else [8, 16, 64, 256, 1024, 2048]
    live_ns = [64, 256, 1024] if quick else [64, 256, 1024, 2048]
    rdzv_ns = [16, 64, 256, 1024] if quick else [16, 64, 256, 1024, 2048]
    steps = 3 if quick else 6
    out: dict[str, Any] = {"quick": quick, "ranks_per_node": RANKS_PER_NODE,
                           "replication_factor": FACTOR}

    progress("calibrating: gloo send/recv of one int64 between two processes")
    link = S.calibrate_link(1000 if quick else 3000)
    progress(f"link {link['link_s'] * 1e6:.0f} us one way, send call {link['send_s'] * 1e6:.0f} us")
    t = time.monotonic()
    pool = S.StorePool(2 * max(ledger_ns + rdzv_ns + live_ns))
    progress(f"{len(pool.conns)} TCPStore connections in {time.monotonic() - t:.1f}s")
    store_cal = S.calibrate_store(pool, S.join_record_bytes(1024, RANKS_PER_NODE, FACTOR))
    sat = S.saturated_service_s(pool)
    counter = S.OpCounter()
    root = S.CountingStore(pool.conns[0], counter, 0, prefix="tree")
    record = _record_fn(root)
    rec_t = []
    for i in range(300):
        t0 = time.perf_counter()
        record(i)
        rec_t.append(time.perf_counter() - t0)
    record_s = statistics.median(rec_t[50:])

    # --- tree commit, virtual time, and its check against real threads -------------
    tree_rows = []
    for n in tree_ns:
        r = S.run_tree_commit(n, steps, link["link_s"], link["send_s"], record_s, record,
                              counter)
        nodes = max(1, n // RANKS_PER_NODE)
        row = {"n": n, "nodes": nodes, "depth": depth_of(n),
               "commit_ms": _ms(statistics.median(r.latencies_s)),
               "messages_per_step": r.messages_per_step,
               "store_requests_per_step": r.store_requests_per_step,
               "store_ops_per_step_per_node": r.store_requests_per_step / nodes,
               "store_ops_per_step_max_node": r.store_requests_max_node_per_step,
               "cpu_per_rank_step_us": round(1e6 * r.cpu_per_rank_step_s, 3)}
        tree_rows.append(row)
        progress(f"tree commit N={n}: {row['commit_ms']:.3f} ms (virtual), "
                 f"{row['messages_per_step']:.0f} messages, "
                 f"{row['store_requests_per_step']:.0f} store requests per step")
    cpu_hop = statistics.median(r["cpu_per_rank_step_us"] for r in tree_rows) / 1e6
    cal = M.Calibration(link["link_s"], link["send_s"], record_s, cpu_hop,
                        store_cal["request_s"], store_cal["per_key_s"])
    checks = []
    for n in (8, 16):
        for lat in (link["link_s"], 2e-3):
            v = S.run_tree_commit(n, 10, lat, 0.0, 0.0, record, counter)
            w = S.run_tree_commit(n, 10, lat, 0.0, 0.0, record, counter, mode="wall")
            vm, wm = statistics.median(v.latencies_s), statistics.median(w.latencies_s)
            checks.append({"n": n, "link_ms": _ms(lat), "virtual_ms": _ms(vm),
                           "wall_ms": _ms(wm), "virtual_over_wall": round(vm / wm, 3)})
            progress(f"virtual vs wall N={n} link {lat * 1e3:.2f} ms: {vm * 1e3:.3f} vs "
                     f"{wm * 1e3:.3f} ms")

    # --- the store count (replication.commit=store), wall clock --------------------
    ledger_rows = []
    for n in ledger_ns:
        r = S.run_ledger_commit(pool, n, steps, RANKS_PER_NODE, f"l{n}")
        nodes = max(1, n // RANKS_PER_NODE)
        row = {"n": n, "nodes": nodes, "commit_ms": _ms(statistics.median(r.latencies_s)),
               "store_requests_per_step": r.requests_per_step,
               "store_ops_per_step_per_node": r.requests_per_step / nodes,
               "store_ops_per_step_max_node": r.requests_max_node_per_step,
               "ops_per_step": r.ops_per_step,
               "queue_model_ms": _ms(M.ledger_commit_queue_s(r.requests_per_step, cal))}
        ledger_rows.append(row)
        progress(f"store-count commit N={n}: {row['commit_ms']:.2f} ms measured, "
                 f"{row['queue_model_ms']:.2f} ms queue model, ops {r.ops_per_step}")

    # --- liveness ------------------------------------------------------------------
    live_rows = []
    offset = 0
    for n in live_ns:
        nodes = n // RANKS_PER_NODE
        r = S.run_liveness(pool, nodes, 3, 0.25, RANKS_PER_NODE, f"n{n}", offset)
        live_rows.append({"n": n, "nodes": nodes,
                          "beat_requests_per_agent": round(r.beat_requests_per_agent, 3),
                          "check_requests_per_agent": r.check_requests_per_agent,
                          "check_keys_per_agent": r.check_keys_per_agent,
                          "check_bytes_per_agent": r.check_bytes_per_agent,
                          "job_keys_per_period": r.check_keys_per_agent * nodes,
                          "check_ms": _ms(r.check_wall_s), "false_losses": r.lost})
        progress(f"liveness {nodes} nodes: a check reads {r.check_keys_per_agent:.0f} keys "
                 f"({r.check_requests_per_agent:.0f} requests), a beat "
                 f"{r.beat_requests_per_agent:.1f} requests")

    # --- rendezvous of one node loss -----------------------------------------------
    rdzv_rows = []
    for n in rdzv_ns:
        r = S.run_rendezvous(pool, n, RANKS_PER_NODE, FACTOR, lost_node=1, gen=1,
                             tag=f"n{n}")
        if not r.providers_ok:
            raise SystemExit(f"rendezvous N={n}: ranks derived different or wrong plans")
        rdzv_rows.append({"n": n, "impl": r.impl, "wall_s": round(r.wall_s, 4),
                          "requests": r.requests, "keys": r.keys, "bytes": r.bytes,
                          "requests_max_node": r.requests_max_node,
                          "cpu_max_rank_s": round(r.cpu_max_rank_s, 5),
                          "cpu_median_rank_s": round(r.cpu_median_rank_s, 5),
                          "newcomers": r.newcomers})
        progress(f"rendezvous ({r.impl}) N={n}: {r.wall_s:.2f}s wall, {r.requests} requests, "
                 f"{r.keys} keys")

    # --- fits and the model -------------------------------------------------------
    ns = [r["n"] for r in tree_rows]
    fits = {
        "tree_commit_ms": M.best_fit(ns, [r["commit_ms"] for r in tree_rows]),
        "old_commit_ms": M.best_fit([r["n"] for r in ledger_rows],
                                    [r["commit_ms"] for r in ledger_rows]),
        "liveness_keys_per_agent": M.best_fit([r["nodes"] for r in live_rows],
                                              [r["check_keys_per_agent"] for r in live_rows]),
    }
    rn = [r["n"] for r in rdzv_rows]
    rfits = {k: M.best_fit(rn, [max(r[k], 1e-9) for r in rdzv_rows])
             for k in ("requests", "keys", "cpu_max_rank_s", "wall_s")}
    fits.update({f"rendezvous_{k}": v for k, v in rfits.items()})
    a = M.Assumptions(heartbeat_timeout_s=RecoveryConfig().heartbeat_timeout_s,
                      heartbeat_interval_s=RecoveryConfig().heartbeat_interval_s)
    model_check = [{"n": r["n"], "harness_ms": r["commit_ms"],
                    "model_ms": _ms(M.tree_commit_s(r["n"], cal))} for r in tree_rows]
    old_req = M.fit_power([r["n"] for r in ledger_rows],
                          [r["store_requests_per_step"] for r in ledger_rows])
    live_fit = fits["liveness_keys_per_agent"]["power"]
    live_req = live_rows[-1]["check_requests_per_agent"] + live_rows[-1]["beat_requests_per_agent"]
    predictions = []
    for n in PREDICT_AT:
        nodes = n // RANKS_PER_NODE
        rec = M.recovery_s(n, rfits, cal, a)
        predictions.append({
            "n": n, "nodes": nodes,
            "tree_commit_ms": _ms(M.tree_commit_s(n, cal)),
            "tree_store_queue_ms": _ms(M.tree_store_queue_s(2, cal)),
            "old_commit_queue_ms": _ms(M.ledger_commit_queue_s(M.evaluate(old_req, n), cal)),
            "old_commit_fit_ms": round(M.evaluate(fits["old_commit_ms"]["power"], n), 3),
            "rendezvous_s": round(rec["rendezvous_s"], 3),
            "rendezvous_requests": round(M.evaluate(rfits["requests"]["power"], n)),
            "rendezvous_keys": round(M.evaluate(rfits["keys"]["power"], n)),
            "recovery_s": round(rec["total_s"], 2),
            "recovery_parts": {k: round(v, 3) for k, v in rec.items()},
            "liveness_store_load": round(M.liveness_store_load(
                nodes, live_req, M.evaluate(live_fit, nodes), cal, a.heartbeat_interval_s), 4),
        })
    by_n = {r["n"]: r for r in tree_rows}
    old_by_n = {r["n"]: r for r in ledger_rows}
    p16 = predictions[-1]
    out.update({
        "commit_ms_64": by_n[64]["commit_ms"], "commit_ms_1024": by_n[1024]["commit_ms"],
        "commit_growth_64_to_1024": round(by_n[1024]["commit_ms"] / by_n[64]["commit_ms"], 3),
        "store_ops_per_step_per_node_64": by_n[64]["store_ops_per_step_per_node"],
        "store_ops_per_step_per_node_1024": by_n[1024]["store_ops_per_step_per_node"],
        "store_ops_per_step_max_node_64": by_n[64]["store_ops_per_step_max_node"],
        "store_ops_per_step_max_node_1024": by_n[1024]["store_ops_per_step_max_node"],
        "store_ops_per_step_per_node_growth_64_to_1024": round(
            by_n[1024]["store_ops_per_step_per_node"] / by_n[64]["store_ops_per_step_per_node"],
            4),
        "old_commit_ms_64": old_by_n[64]["commit_ms"],
        "old_commit_ms_1024": old_by_n[1024]["commit_ms"],
        "old_commit_growth_64_to_1024": round(
            old_by_n[1024]["commit_ms"] / old_by_n[64]["commit_ms"], 3),
        "old_commit_queue_model_ms_1024": old_by_n[1024]["queue_model_ms"],
        "old_store_ops_per_step_per_node_64": old_by_n[64]["store_ops_per_step_per_node"],
        "old_store_ops_per_step_per_node_1024": old_by_n[1024]["store_ops_per_step_per_node"],
        "rendezvous_impl": rdzv_rows[-1]["impl"],
        "recovery_store_ops_1024": {r["n"]: r for r in rdzv_rows}[1024]["requests"],
        "recovery_store_keys_1024": {r["n"]: r for r in rdzv_rows}[1024]["keys"],
        "recovery_rendezvous_s_1024": {r["n"]: r for r in rdzv_rows}[1024]["wall_s"],
        "liveness_keys_per_agent_1024": {r["n"]: r for r in live_rows}[1024][
            "check_keys_per_agent"],
        "liveness_requests_per_agent_1024": live_req,
        "predicted_commit_ms_16384": p16["tree_commit_ms"],
        "predicted_old_commit_ms_16384": p16["old_commit_queue_ms"],
        "predicted_old_commit_fit_ms_16384": p16["old_commit_fit_ms"],
        # A crashed node (its agent's connections closed by its kernel), the loss
        # bench_node_loss measures; a silent machine and a stalled agent alongside.
        "predicted_recovery_s_16384": p16["recovery_s"],
        **{f"predicted_recovery_s_16384_{kind}": round(
            M.recovery_s(PREDICT_AT[-1], rfits, cal, a, kind)["total_s"], 2)
           for kind in M.DETECTION_KINDS},
        "predicted_detection_s": {kind: round(M.detection_s(a, kind), 2)
                                  for kind in M.DETECTION_KINDS},
        "predicted_recovery_s_16384_without_detection": round(
            p16["recovery_s"] - p16["recovery_parts"]["detection_s"], 2),
        # The stalled agent's detection is a setting, not a cost of scale: the same
        # prediction with recovery.heartbeat_timeout_s=10 instead of the default 15 s.
        "predicted_recovery_s_16384_stalled_at_heartbeat_timeout_10s": round(
            p16["recovery_s"] - p16["recovery_parts"]["detection_s"]
            + M.detection_s(dataclasses.replace(a, heartbeat_timeout_s=10.0), "stalled"), 2),
        "predicted_liveness_store_load_16384": p16["liveness_store_load"],
        **{f"data_plane_bytes_per_rank_per_step_{n}": {
            k: round(v) for k, v in M.data_plane_bytes_per_rank_per_step(n, a).items()}
           for n in (1024, 16384)},
        # a 70B FSDP2 job's live-state costs (ADR 0049): no measurement feeds this model
        **{f"sharded_recovery_costs_{n}": {
            k: round(v, 4) for k, v in M.sharded_recovery_costs(M.ShardedJob(n=n)).items()}
           for n in (64, 1024)},
        "calibration": {**M.as_dict(cal), "link_rtt_p90_s": link["rtt_p90_s"],
                        "link_rtt_all_batches_median_s": link["rtt_all_median_s"],
                        "store_request_p90_s": store_cal["request_p90_s"],
                        "store_saturated_s_per_request": sat},
        "assumptions": M.as_dict(a),
        "tree": tree_rows, "old": ledger_rows, "liveness": live_rows,
        "rendezvous": rdzv_rows, "virtual_vs_wall": checks, "model_vs_harness": model_check,
        "fits": fits, "predictions": predictions,
    })
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    t = time.monotonic()
    res = measure(args.quick)
    res["elapsed_s"] = round(time.monotonic() - t, 1)
    if args.write_docs or not args.quick:
        from benchmarks import scale_docs

        scale_docs.write(res, DOC, PLOT, BEGIN, END)
        progress(f"wrote {DOC.relative_to(REPO)} and {PLOT.relative_to(REPO)}")
    progress(f"done in {res['elapsed_s']}s")
    emit(res)
    os._exit(0)  # thousands of c10d clients: skip their one-by-one teardown


if __name__ == "__main__":
    main()
