"""``benchmarks/bench_snapshot.py`` on a tiny state: the acceptance keys, and its arithmetic.

The figures of a run this small mean nothing (they are dominated by fixed costs); what
is checked is that the benchmark runs end to end on 2 processes and that its last line
is one JSON object with every key the acceptance criteria read, each ratio being the
quotient of the figures it names.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: ratio key -> (numerator key, denominator key)
RATIOS = {
    "stall_over_memcpy": ("stall_s", "memcpy_s"),
    "torch_save_over_stall": ("torch_save_s", "stall_s"),
    "dcp_async_block_over_stall": ("dcp_async_block_s", "stall_s"),
    "replication_over_raw_send": ("replication_s", "raw_send_s"),
}
REQUIRED = {"state_bytes", "train_step_overhead", "overhead_over_copy_cost",
            *RATIOS, *(k for pair in RATIOS.values() for k in pair)}


def _quotient_ok(ratio: float, num: float, den: float, half_unit: float = 0.5e-6) -> bool:
    """``ratio == num / den``, up to the rounding of all three to 6 decimals in the output
    (to first order: the ratio's own rounding, plus ``num`` and ``den`` each off by half a
    unit)."""
    q = num / den
    return abs(ratio - q) <= half_unit * (1 + (1 + abs(q)) / abs(den)) * 1.01


def test_tiny_run_prints_every_required_key_as_the_last_line():
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_snapshot", "--quick", "--width", "256",
         "--layers", "2", "--reps", "2", "--save-reps", "1", "--blocks", "2",
         "--block-steps", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    missing = REQUIRED - set(result)
    assert not missing, f"missing keys {sorted(missing)} in {sorted(result)}"
    for key in REQUIRED:
        assert isinstance(result[key], (int, float)) and math.isfinite(result[key]), key
    for ratio, (num, den) in RATIOS.items():
        assert _quotient_ok(result[ratio], result[num], result[den]), (ratio, result)
    # 2 layers of 256 x 256 fp32 weights, biases and Adam's two moments, at least.
    assert result["state_bytes"] >= 2 * 3 * (256 * 256 + 256) * 4, result["state_bytes"]
    assert _quotient_ok(result["overhead_over_copy_cost"], result["added_s"],
                        result["memcpy_s"]), result
