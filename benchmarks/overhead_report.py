"""Render bench_overhead's figures as the Markdown tables of docs/performance.md.

    python -m benchmarks.overhead_report [--write]

Reads ``bench_overhead`` from ``benchmarks/results/latest.json``; prints the tables, or
with ``--write`` replaces the text between the ``<!-- overhead:begin -->`` and
``<!-- overhead:end -->`` markers of docs/performance.md, so the document always shows
the figures of the last recorded run, never numbers typed by hand.
"""

from __future__ import annotations

import argparse
import json
import re

from benchmarks._harness import REPO

DOC = REPO / "docs" / "performance.md"
BEGIN, END = "<!-- overhead:begin -->", "<!-- overhead:end -->"
RBEGIN, REND = "<!-- readme:begin -->", "<!-- readme:end -->"

PROFILE_ROWS = [
    ("added_ms", "added to training per snapshot (step time vs plain)"),
    ("loop_stall_ms", "in the loop: all stalls below"),
    ("loop_capture_ms", "  capture (`snapshot()`: small tensors, skeletons, starting the round)"),
    ("loop_wait_prev_round_ms", "  waiting for the previous round to end"),
    ("loop_fence_ms", "  optimizer step waiting at the fence for the overlapped copy"),
    ("round_seal_copy_hash_ms", "round thread: overlapped copy + hash (seal)"),
    ("round_announce_ms", "round thread: announce allgather (waits for the slower rank)"),
    ("round_receive_wait_ms", "round thread: waiting for replica chunks (the transfer)"),
    ("round_receive_hash_ms", "round thread: hashing received chunks (receiver verify)"),
    ("round_send_rest_ms", "round thread: posting sends, waiting for them"),
    ("round_commit_ms", "round thread: commit (tree agreement + store record)"),
    ("added_minus_loop_stall_ms", "added time not in a loop stall (cpu: thread contention)"),
]


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:+.1f} %"


def tables(r: dict) -> str:
    out: list[str] = []
    kinds = [k for k in ("cpu", "device") if f"overhead_plain_k2_every1_{k}" in r]
    loads = r.get("load_avg_1m", [])
    out.append(f"Run: {'quick' if r.get('quick') else 'full'} mode, state "
               f"{r['state_bytes'] / 2**20:.0f} MiB per rank, every N = {r['every_n']}, "
               f"wall {r.get('wall_s')} s; 1-minute load average around the jobs "
               f"{min(x['before'] for x in loads):.1f}-{r['load_avg_1m_max']:.1f} "
               "(2 cores).")
    out.append("")
    out.append("Overhead against plain training (mean step time / plain's - 1), per point:")
    out.append("")
    out.append("| step | GB/s per rank (measured) | plain step | k=1 every 1 | k=1 every N "
               "| k=2 every 1 | k=2 every N |")
    out.append("|---|---|---|---|---|---|---|")
    for kind in kinds:
        for rate in r["rates_gbps"]:
            key = f"{kind}_{rate}"
            if f"overhead_k2_every1_{key}" not in r:
                continue
            cells = [_pct(r.get(f"overhead_{m}_{e}_{key}")) for m in ("k1", "k2")
                     for e in ("every1", "everyN")]
            out.append(f"| {kind} | {rate} ({r[f'rate_gbps_{key}']:.2f}) | "
                       f"{1e3 * r[f'plain_step_s_{key}']:.1f} ms | " + " | ".join(cells) + " |")
    out.append("")
    for kind in kinds:
        nos = r.get(f"overhead_plain_k2_nosnap_{kind}")
        out.append(f"- {kind}: the runtime with no snapshot at all (its per-step bookkeeping) "
                   f"{_pct(nos)}; torchrun + DCP `async_save` costs "
                   f"{1e3 * r[f'dcp_save_cost_s_{kind}']:.1f} ms per save, a k=2 snapshot "
                   f"{1e3 * r[f'k2_snapshot_cost_s_{kind}']:.1f} ms (every-N phases).")
    for kind in kinds:
        if f"overhead_plain_default_{kind}" not in r:
            continue
        out.append(f"- {kind}: a job with no settings (the default interval, `auto`) at "
                   f"0.5 GB/s: {_pct(r[f'overhead_plain_default_{kind}'])} against plain "
                   f"over all its {r.get(f'default_steps_{kind}')} steps, the probe's "
                   f"included ({_pct(r.get(f'overhead_plain_default_steady_{kind}'))} from "
                   f"step 96 on; {_pct(r.get(f'overhead_default_{kind}_same_run'))} against "
                   "the same run's own unsnapshotted steps); last interval "
                   f"{r.get(f'default_interval_steps_{kind}')} steps. Its reasons: "
                   f"{'; '.join(r.get(f'default_reasons_{kind}') or [])}")
    out.append("")
    out.append("Where a k=2 round's time goes at 0.5 GB/s per rank, per snapshot, every step "
               "(ms; the round's parts overlap the next step):")
    out.append("")
    out.append("| part | " + " | ".join(kinds) + " |")
    out.append("|---|" + "---|" * len(kinds))
    for key, label in PROFILE_ROWS:
        vals = [r[f"profile_k2_every1_{k}"].get(key) for k in kinds]
        out.append(f"| {label} | " + " | ".join("n/a" if v is None else f"{v:.1f}"
                                               for v in vals) + " |")
    out.append("")
    out.append("Goodput model (benchmarks/goodput_model.py) with this run's costs:")
    out.append("")
    out.append("| MTBF | " + " | ".join(f"{k}: checkpointless / DCP (interval)" for k in kinds)
               + " |")
    out.append("|---|" + "---|" * len(kinds))
    curves = {k: r.get("goodput_curve" + ("" if k == "device" else f"_{k}")) for k in kinds}
    for label in ("1min", "10min", "1h", "3h", "24h"):
        cells = []
        for k in kinds:
            c = (curves[k] or {}).get(label)
            cells.append("n/a" if c is None else
                         f"{c['checkpointless']:.4f} (every {c['cl_every_n']}) / "
                         f"{c['dcp']:.4f} ({c['dcp_interval_s']:.0f} s)")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    out.append("")
    for k in kinds:
        sfx = "" if k == "device" else f"_{k}"
        cross = r.get(f"crossover_mtbf_s{sfx}")
        out.append(f"- {k}: goodput ratio at a 3 h MTBF "
                   f"{r.get(f'goodput_ratio_at_mtbf_3h{sfx}', float('nan')):.4f}; crossover "
                   f"{'none in 1 min - 24 h' if cross is None else f'{cross / 3600:.2f} h'}.")
    src = r.get("goodput_recovery_source", {})
    if src:
        out.append(f"- Recovery {src['cl_recovery_s']:.2f} s and torchrun restart "
                   f"{src['dcp_restart_s']:.2f} s (measured {src['dcp_restart_measured_s']:.2f}"
                   f" s less {src['dcp_restart_redo_s']:.2f} s of redone steps) from "
                   f"{src['source']}.")
    return "\n".join(out) + "\n"


def readme(r: dict) -> str:
    """The short version for docs/guide/performance.md (pasted there by hand)."""
    loads = r.get("load_avg_1m", [])
    dev = r.get("goodput_curve", {})
    lines = [
        "**What it costs, and when it pays.** Measured side by side against plain training "
        f"(`benchmarks/bench_overhead.py`; 2 ranks, {r['state_bytes'] / 2**20:.0f} MiB of state "
        "each, this 2-core host, "
        f"load average {min(x['before'] for x in loads):.1f}-{r['load_avg_1m_max']:.1f}):",
        "",
        f"- On a GPU-like step (the host waits for the device) at 0.5 GB/s of state per rank, "
        f"replicating every step to a second node (k=2) adds "
        f"{_pct(r['overhead_plain_k2_every1_device'])} to the step, every 8 steps "
        f"{_pct(r['overhead_plain_k2_everyN_device'])}; at 2 GB/s every step no longer fits "
        f"(the loopback transfer outlasts the step: "
        f"{_pct(r.get('overhead_k2_every1_device_2.0'))}), every 8 steps "
        f"{_pct(r.get('overhead_k2_everyN_device_2.0'))}.",
        f"- When training uses every core of the host, k=2 every step costs "
        f"{_pct(r['overhead_plain_k2_every1_cpu'])}; the default (`replication."
        "every_n_steps: auto`, which measures the cost and picks Daly's interval for the "
        "job's MTBF within `replication.max_overhead`) costs "
        f"{_pct(r.get('overhead_plain_default_cpu'))} against plain jobs run before and "
        "after it "
        f"(every {r.get('default_interval_steps_cpu')} steps; "
        f"{_pct(r.get('overhead_default_cpu_same_run'))} against the same run's own "
        "steps), and on GPU-like steps "
        f"{_pct(r.get('overhead_plain_default_device'))}.",
        "- Against torchrun + DCP `async_save` at its optimal interval, with this host's "
        "measured recovery and restart times, checkpointless keeps more goodput "
        + ("at every MTBF from 1 minute to 24 hours" if r.get("crossover_mtbf_s") is None
           else f"below an MTBF of {r['crossover_mtbf_s'] / 3600:.1f} h")
        + " on the device-like step (3 h MTBF: "
        f"{dev.get('3h', {}).get('checkpointless', float('nan')):.4f} vs "
        f"{dev.get('3h', {}).get('dcp', float('nan')):.4f}, ratio "
        f"{r['goodput_ratio_at_mtbf_3h']:.4f}); the margin is small at long MTBFs, because "
        "both then lose little, and it grows with the restart time (minutes on a real "
        "cluster, seconds here). Plot and details: docs/performance.md.",
    ]
    cpu_cross = r.get("crossover_mtbf_s_cpu")
    if cpu_cross is not None:
        lines.append(f"- On CPU-bound steps the model's crossover is {cpu_cross / 3600:.1f} h: "
                     "above it, torchrun + DCP's cheaper saves win.")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    r = json.loads((REPO / "benchmarks" / "results" / "latest.json").read_text())
    text = tables(r["bench_overhead"])
    if not args.write:
        print(text)
        return
    doc = DOC.read_text()
    for (begin, end), body in (((BEGIN, END), text),
                               ((RBEGIN, REND), readme(r["bench_overhead"]))):
        pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
        if not pattern.search(doc):
            raise SystemExit(f"{DOC}: no {begin} ... {end} markers")
        doc = pattern.sub(lambda _m, b=begin, e=end, t=body: f"{b}\n{t}{e}", doc)
    DOC.write_text(doc)


if __name__ == "__main__":
    main()
