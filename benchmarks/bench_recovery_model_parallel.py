"""In-process recovery of a tensor-parallel job against a torchrun full restart of it.

The same measurement as ``bench_recovery`` (``measure_wrap``: a failure-free reference,
rank 1 SIGKILLed in step K's backward and recovered with a warm spare, and the job
under plain ``torchrun`` with a synchronous DCP checkpoint every N steps, SIGKILLed
whole at step K and restarted), on the same MLP, split by DTensor's
``parallelize_module`` over the two ranks (each pair of linear layers column-wise then
row-wise; both ranks read the same batch; ``--wrap tp`` of
``benchmarks/recovery_worker.py``). A benchmark of its own so that each keeps its quick
mode under two minutes. Pipeline and 2-D layouts are not measured yet. The last stdout
line is JSON.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks._harness import emit, progress
from benchmarks.bench_recovery import JobSize, measure_wrap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    args = ap.parse_args()
    q = args.quick
    size = JobSize.for_mode(q)  # bench_recovery's job, so the two compare
    # each rank holds half of every weight, with Adam's two moments
    state_bytes = 3 * 4 * size.layers * (size.width * size.width + size.width) // 2
    tmp = Path(tempfile.mkdtemp(prefix="bench_recovery_mp_"))
    t0 = time.perf_counter()
    try:
        progress(f"tensor parallel over 2 ranks, about {state_bytes / 2**20:.0f} MiB per rank")
        tp = measure_wrap(tmp, "tp", size.worker_args(), size.kill_step)
        result = {
            "quick": q,
            "state_bytes_per_rank": state_bytes,
            "kill_step": size.kill_step,
            "dcp_every_n_steps": size.dcp_every,
            "recovery_over_restart_tp": tp["recovery_over_restart"],
            "bit_identical": tp["bit_identical"],
            "tp": tp,
            "wall_s": round(time.perf_counter() - t0, 1),
        }
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    emit(result)


if __name__ == "__main__":
    main()
