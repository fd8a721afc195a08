"""The update log's always-on cost for an FSDP2 job (ADR 0049), side by side in one run.

    python -m benchmarks.bench_overhead_sharded [--quick]      (last stdout line: JSON)

``bench_overhead`` measures a data-parallel job; a sharded job's marks also carry its
optimizers' inputs (the local gradient shards and the hyperparameters) to its replica
holders every step, so its live rollback costs more. The same FSDP2 job
(``benchmarks/recovery_worker.py --wrap fsdp2``: 2 nodes x 1 worker on this host, each
``fully_shard``-ing a stack of linear layers) runs under ``checkpointless run`` at the
defaults (``every_n_steps: auto``, factor 2) two ways, alternated ``on, off, on, off``
so the host's drift falls on both: **on** (live rollback with update logs, the
default) and **off** (``recovery.live_rollback=false``: snapshots only). Two kinds
of step: ``cpu`` (the forward and backward on the host's cores, shared with the
runtime's threads) and ``device`` (the same, plus an idle wait per step standing for
a device's kernels, ``--device-ms``; the host's work per step is unchanged).

Figures: ``log_overhead_<kind>`` = median step time on / off - 1, over the steps after
the probe (from step 65: the interval is chosen by then on both sides);
``step_s_<on|off>_<kind>``; ``log_bytes_per_rank`` (what a rank's logs held at the
end) next to ``state_bytes_per_rank``.

What it does not capture: a GPU. There the recorder's copy stays on the device and the
mark's copy is a device-to-host copy on the training thread; both are host memcpy
here. And 2 ranks on one host, so the marks cross loopback, not a network.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

from benchmarks._harness import emit, free_port, job_env, progress, wait_all

REPO = Path(__file__).resolve().parent.parent
FIRST_TIMED = 65  # the probe's 64 steps, then the chosen interval on both sides


def run_job(out: Path, args: list[str], live: bool) -> Path:
    """Two agents (two nodes, one worker each); returns ``out``."""
    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", out.name, "--run-dir", str(out / "run")]
    if not live:
        common.append("recovery.live_rollback=false")
    script = [str(REPO / "benchmarks" / "recovery_worker.py"), "--mode", "checkpointless",
              "--wrap", "fsdp2", "--out", str(out), *args]
    procs = [subprocess.Popen([sys.executable, "-m", "launcher.cli", "run", "--node-rank",
                               str(n), *common, *script], cwd=REPO, env=job_env(),
                              start_new_session=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
             for n in (0, 1)]
    rcs = wait_all(procs, 600)
    if any(rcs):
        raise SystemExit(f"the FSDP2 job failed with exit codes {rcs}; see {out / 'run'}")
    return out


def step_seconds(out: Path) -> list[float]:
    """Rank 0's step times from :data:`FIRST_TIMED` on."""
    rows = [json.loads(x) for x in (out / "progress.jsonl").read_text().splitlines()]
    ts = {r["step"]: r["ts"] for r in rows if r["rank"] == 0 and "step" in r}
    return [ts[s] - ts[s - 1] for s in sorted(ts) if s >= FIRST_TIMED and s - 1 in ts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="one job per side and kind, a quarter of the state and half the "
                    "device wait, 20 timed steps: < 2 min, a smoke test of the figures")
    ap.add_argument("--width", type=int, default=None, help="default 1024 (quick: 512)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--device-ms", type=float, default=None, help="default 300 (quick: 150)")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    a = ap.parse_args()
    a.width = a.width or (512 if a.quick else 1024)
    a.device_ms = a.device_ms if a.device_ms is not None else (150.0 if a.quick else 300.0)
    steps, repeats = (FIRST_TIMED + 20, 1) if a.quick else (200, 2)
    tmp = Path(tempfile.mkdtemp(prefix="bench_overhead_sharded_"))
    t0 = time.perf_counter()
    result: dict = {"quick": a.quick, "steps": steps, "width": a.width, "layers": a.layers,
                    "device_ms": a.device_ms}
    try:
        for kind, device_ms in (("cpu", 0.0), ("device", a.device_ms)):
            args = ["--steps", str(steps), "--width", str(a.width), "--layers", str(a.layers),
                    "--device-ms", str(device_ms)]
            times: dict[str, list[float]] = {"on": [], "off": []}
            for i in range(repeats):
                for side in ("on", "off"):
                    progress(f"[{kind}] live rollback {side}, run {i + 1} of {repeats}")
                    out = run_job(tmp / f"{kind}_{side}_{i}", args, side == "on")
                    times[side] += step_seconds(out)
                    if side == "on":
                        final = json.loads((out / "final_rank0.json").read_text())
                        result["log_bytes_per_rank"] = final["log_bytes"]
                        result["state_bytes_per_rank"] = final["state_bytes"]
            on, off = median(times["on"]), median(times["off"])
            result[f"step_s_on_{kind}"] = round(on, 5)
            result[f"step_s_off_{kind}"] = round(off, 5)
            result[f"log_overhead_{kind}"] = round(on / off - 1, 4)
    finally:
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    emit(result)


if __name__ == "__main__":
    main()
