"""A warm spare yields the CPU while it warms up and waits, and its assigned rank runs
at the job's own priority, on every thread (a real ``python -m launcher.spare``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from launcher.spare import SPARE_NICE, WarmUpPriority
from tests.recovery_harness import REPO, clean_env

REPORT = """
import json, os, sys, threading, torch
torch.set_num_threads(2)
torch.ones(256, 256) @ torch.ones(256, 256)  # start the intra-op pool
tids = [int(t) for t in os.listdir("/proc/self/task")]
print(json.dumps({str(t): os.getpriority(os.PRIO_PROCESS, t) for t in tids}))
"""


@pytest.mark.skipif(not WarmUpPriority().can_restore(),
                    reason="this user cannot raise a priority back (RLIMIT_NICE)")
def test_spare_waits_niced_and_runs_its_rank_at_the_job_priority(tmp_path):
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    env = {**clean_env(), "OMP_NUM_THREADS": "2"}  # the warm-up starts a thread pool
    proc = subprocess.Popen([sys.executable, "-u", "-m", "launcher.spare"], cwd=REPO, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        waiting = psutil.Process(proc.pid)
        deadline = time.monotonic() + 60
        while waiting.nice() != min(19, base + SPARE_NICE) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert waiting.nice() == min(19, base + SPARE_NICE)
        while waiting.num_threads() < 3 and time.monotonic() < deadline:
            time.sleep(0.05)  # the warm-up step started torch's intra-op pool, niced
        line = json.dumps({"env": {}, "argv": [str(script)], "module": False}) + "\n"
        out, err = proc.communicate(line.encode(), timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()[-2000:]
    per_thread = json.loads(out.decode().strip().splitlines()[-1])
    assert len(per_thread) >= 2, per_thread
    assert set(per_thread.values()) == {base}, per_thread


def test_no_lowering_without_the_right_to_restore(monkeypatch):
    prio = WarmUpPriority()
    monkeypatch.setattr(prio, "can_restore", lambda: False)
    prio.lower()
    assert not prio.active and os.getpriority(os.PRIO_PROCESS, 0) == prio.orig
