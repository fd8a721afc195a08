"""Warm spares forked from the agent's zygote (ADR 0011), with real processes.

The driver (``tests/workers/zygote_driver.py``) plays the agent: a child subreaper
holding a zygote and a spare pool. It hands scripts to forked spares and reports what
they saw. What must hold:

- a forked spare is the agent's own child (it can be waited for, its exit status and
  signals are the script's); it waits below the job's priority and runs its rank at
  it, while the warm zygote answers at the job's priority;
- two spares do not share Python's random stream;
- a spare's durable helper is forked in advance and is the one the writer uses: a
  real save through it commits and loads; orphaned helpers are reaped by the agent;
- a dead zygote costs nothing but speed: the pool falls back to ``Popen`` spares.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.recovery_harness import REPO, clean_env

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="fork + subreaper: Linux")

REPORT = """
import json, os, random, sys
from replication.durable import worker
pre = worker._preforked
with open(os.environ["OUT"], "w") as f:
    json.dump({"pid": os.getpid(), "ppid": os.getppid(), "random": random.random(),
                  "nice": os.getpriority(os.PRIO_PROCESS, 0), "rank": os.environ["RANK"],
               "helper": pre.pid if pre else None}, f)
sys.exit(int(os.environ["EXITCODE"]))
"""

SAVE = """
import json, os, sys
sys.path.insert(0, {repo!r})
from replication.durable import DurableWriter, list_checkpoints, load, worker
from replication.forked import ForkedProcess
from replication.snapshots.snapshot import SnapshotEngine
from tests.test_durable_support import config, make_state, snapshot, train

pre = worker._preforked.pid
state, objs = make_state()
engine = SnapshotEngine(state)
writer = DurableWriter(config({path!r}), 0, 1)
backend = writer._backend
train(objs)
result = writer.submit(*snapshot(engine, 1)).result(120)
writer.close()
fresh, _ = make_state(seed=5)
with open(os.environ["OUT"], "w") as f:
    json.dump({{"preforked": pre, "helper": backend.proc.pid,
                  "forked": isinstance(backend.proc, ForkedProcess),
                  "status": result.status, "helper_exit": backend.proc.poll(),
                  "steps": [c.step for c in list_checkpoints({path!r})],
                  "loaded": load({path!r}, fresh).step}}, f)
"""


def drive(cfg: dict) -> dict:
    proc = subprocess.run([sys.executable, "-m", "tests.workers.zygote_driver", json.dumps(cfg)],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["log"] = proc.stdout + proc.stderr
    return out


def test_forked_spares_are_the_agents_children_and_run_their_ranks(tmp_path):
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    outs = [tmp_path / "r0.json", tmp_path / "r1.json"]
    out = drive({"scripts": [[str(script), {"RANK": "0", "EXITCODE": "0", "OUT": str(outs[0])}],
                             [str(script), {"RANK": "1", "EXITCODE": "3", "OUT": str(outs[1])}]]})
    assert out["subreaper"] and out["forked"] == [True, True]
    job_nice = os.getpriority(os.PRIO_PROCESS, 0)
    reports = []
    for res, code, path in zip(out["results"], (0, 3), outs):
        assert res["code"] == code, out["log"]  # the script's own exit status
        rep = json.loads(path.read_text())
        assert rep["ppid"] == out["driver_pid"]  # adopted: the agent can wait for it
        assert rep["nice"] == job_nice  # the rank runs at the job's priority
        assert rep["helper"] is not None and rep["helper"] != rep["pid"]
        reports.append(rep)
    assert reports[0]["random"] != reports[1]["random"]
    # Once warm, the zygote answers at the job's priority; its spares wait below it
    # (where this user may restore a priority) and run their ranks at it (above).
    from launcher.spare import SPARE_NICE, WarmUpPriority

    assert out["zygote_nice"] == job_nice
    if WarmUpPriority().can_restore():
        assert out["spare_nice"] == [min(19, job_nice + SPARE_NICE)] * 2
    # The idle pre-forked helpers outlived their spares and were reaped as orphans.
    assert sorted(out["reaped"]) == sorted(r["helper"] for r in reports)
    assert out["zygote_exit"] == 0  # it leaves when the agent closes its socket
    assert "zygote_ready" in out["events"]


def test_a_forked_spares_durable_helper_is_preforked_and_saves(tmp_path):
    script = tmp_path / "save.py"
    path = tmp_path / "ckpt"
    script.write_text(SAVE.format(repo=str(REPO), path=str(path)))
    report = tmp_path / "r0.json"
    out = drive({"scripts": [[str(script), {"RANK": "0", "OUT": str(report)}]]})
    [res] = out["results"]
    assert res["code"] == 0, out["log"]
    rep = json.loads(report.read_text())
    assert rep["forked"] and rep["helper"] == rep["preforked"]
    assert rep["status"] == "ok" and rep["steps"] == [1] and rep["loaded"] == 1
    assert rep["helper_exit"] is not None  # closed with the writer, and waited for


def test_a_dead_zygote_falls_back_to_new_interpreters(tmp_path):
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    out = drive({"scripts": [[str(script), {"RANK": "0", "EXITCODE": "0",
                                            "OUT": str(tmp_path / "r0.json")}]],
                 "kill_zygote": True})
    assert out["take_after_death"] is None
    assert out["refill_kind"] == ["Popen"]
    assert "zygote_failed" in out["events"]
    assert out["results"][0]["code"] == 0, out["log"]  # forked before the death: still works


def test_a_zygote_that_dies_while_importing_is_marked_failed_not_raised():
    """The agent's loop polls ``ready()``: a zygote gone before it was warm must turn
    into a fallback (``usable`` False, a ``zygote_failed`` event), never an exception."""
    import signal
    import time

    from launcher.zygote import Zygote

    events: list[str] = []
    zygote = Zygote(clean_env(), lambda event, **_: events.append(event))
    zygote.start()
    time.sleep(0.2)
    os.kill(zygote.proc.pid, signal.SIGKILL)
    zygote.proc.wait()
    assert zygote.ready(wait_s=5.0) is False
    assert not zygote.usable and events == ["zygote_start", "zygote_failed"]
    zygote.stop()


