"""Plays the agent's part for tests/test_zygote.py: a subreaper with a zygote and a
spare pool. Runs in its own process so that pytest never becomes a subreaper.

``python -m tests.workers.zygote_driver CONFIG_JSON`` prints one JSON line, last; the
spares' own output is relayed before it, labelled as the agent labels it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from launcher import reaper, worker_output
from launcher.worker_procs import SparePool
from launcher.zygote import Zygote
from replication.forked import ForkedProcess


def _settled_nice(pid: int, start: int, wait_s: float = 10.0) -> int:
    """A waiting spare's nice value, once it has lowered itself (or after ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    nice = os.getpriority(os.PRIO_PROCESS, pid)
    while nice == start and time.monotonic() < deadline:
        time.sleep(0.02)
        nice = os.getpriority(os.PRIO_PROCESS, pid)
    return nice


def run_spares(cfg: dict) -> dict:
    events: list[dict] = []

    def emit(event: str, **fields) -> None:
        events.append({"event": event, **fields})

    out: dict = {"driver_pid": os.getpid(), "subreaper": reaper.become_subreaper()}
    zygote = Zygote(dict(os.environ), emit)
    zygote.start()
    pool = SparePool(len(cfg["scripts"]), dict(os.environ), emit, zygote)
    pool.refill_delay_s = pool.forked_refill_delay_s = 0.0
    deadline = time.monotonic() + 120
    while not zygote.ready(wait_s=0.1):
        assert time.monotonic() < deadline, "the zygote never got ready"
    pool.fill()
    out["zygote_nice"] = os.getpriority(os.PRIO_PROCESS, zygote.proc.pid)
    spares = [pool.take() for _ in cfg["scripts"]]
    out["forked"] = [isinstance(p, ForkedProcess) for p in spares]
    out["spare_nice"] = [_settled_nice(p.pid, out["zygote_nice"]) for p in spares]
    if cfg.get("kill_zygote"):
        os.kill(zygote.proc.pid, signal.SIGKILL)
        zygote.proc.wait()
        after = pool.take() or pool.fork(0.0)  # none idle, and no zygote to fork from
        out["take_after_death"] = None if after is None else after.pid
        pool.fill()
        out["refill_kind"] = [type(p).__name__ for p in pool._idle]
    results = []
    for proc, (script, env) in zip(spares, cfg["scripts"]):
        assert proc is not None
        SparePool.assign(proc, env, [script], False)
    for proc in spares:
        code = proc.wait(timeout=120)
        results.append({"pid": proc.pid, "code": code})
    out["results"] = results
    time.sleep(0.5)
    known = pool.pids()
    out["reaped"] = reaper.reap_orphans(known)
    pool.stop()
    out["zygote_exit"] = zygote.proc.poll() if zygote.proc else None
    out["events"] = [e["event"] for e in events]
    worker_output.drain()  # the spares' relayed output comes before our JSON line
    return out


if __name__ == "__main__":
    print(json.dumps(run_spares(json.loads(sys.argv[1]))), flush=True)
