"""The GPU check (``make test-gpu``) runs rarely; this keeps its plumbing from rotting.

A dry run spawns the CUDA-free check in its own process and reports every other check
as skipped: the lines must be valid JSON with the agreed fields, and land under $OUT.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIELDS = {"name", "passed", "seconds", "figures", "error"}


def test_dry_run_reports_every_check_as_json(tmp_path: Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests/gpu/run_gpu_check.py"), "--dry-run"],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    checks, summary = lines[:-1], lines[-1]
    assert len(checks) >= 10 and all(set(c) == FIELDS for c in checks)
    assert len({c["name"] for c in checks}) == len(checks)
    ran = [c for c in checks if c["passed"] is not None]
    assert [c["name"] for c in ran] == ["dependencies"] and ran[0]["passed"] is True
    assert all(c["error"] == "skipped: dry run" for c in checks if c["passed"] is None)
    assert summary["summary"] is True and summary["failed"] == []
    assert summary["skipped"] == len(checks) - 1
    saved = (tmp_path / "gpu_check.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in saved] == lines
