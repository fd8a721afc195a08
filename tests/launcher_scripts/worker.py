"""A tiny stand-in for a training script, driven by flags (no recovery runtime needed).

It records who it is (pid, environment) in ``OUT/rank<R>.jsonl``, touches its heartbeat
file from a thread (as the runtime would), then waits until ``OUT/finish`` exists and
exits 0. Flags inject the behaviour a test needs: fail once, finish when a replacement
starts, set the job's fatal flag, or run a real gloo all-reduce through ``env://``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

HEARTBEAT = "CHECKPOINTLESS_INTERNAL_HEARTBEAT"
REPLACEMENT = "CHECKPOINTLESS_INTERNAL_REPLACEMENT"


def beat(path: str, interval: float) -> None:
    while True:
        try:
            os.utime(path)
        except OSError:
            pass
        time.sleep(interval)


def record(out: str, rank: int, extra: dict) -> None:
    line = json.dumps({"pid": os.getpid(), "env": dict(os.environ), **extra}) + "\n"
    with open(os.path.join(out, f"rank{rank}.jsonl"), "a") as f:
        f.write(line)


def all_reduce() -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")  # env:// : MASTER_ADDR/PORT, RANK, WORLD_SIZE
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return float(t.item())


def set_fatal(reason: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from recovery.generation import protocol

    host, port = os.environ["CHECKPOINTLESS_INTERNAL_STORE"].rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
    protocol.set_fatal(store, reason)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--fail-once", type=int, default=-1, help="this rank exits 1 on its first run")
    p.add_argument("--replacement-finishes", action="store_true")
    p.add_argument("--fatal", type=int, default=-1, help="this rank sets the fatal flag")
    p.add_argument("--dist", action="store_true", help="gloo all-reduce via env://")
    p.add_argument("--no-heartbeat", action="store_true")
    p.add_argument("--timeout", type=float, default=45.0)
    a = p.parse_args()
    rank = int(os.environ["RANK"])
    if not a.no_heartbeat and os.environ.get(HEARTBEAT):
        threading.Thread(target=beat, args=(os.environ[HEARTBEAT], 0.2), daemon=True).start()
    extra: dict = {"argv": sys.argv[1:]}
    if a.dist:
        extra["all_reduce"] = all_reduce()
    record(a.out, rank, extra)
    finish = os.path.join(a.out, "finish")
    if rank == a.fail_once:
        marker = os.path.join(a.out, f"failed{rank}")
        if not os.path.exists(marker):
            open(marker, "w").close()
            return 1
    if a.replacement_finishes and os.environ.get(REPLACEMENT) == "1":
        open(finish, "w").close()
    if rank == a.fatal:
        set_fatal(f"rank {rank} says the job cannot go on")
    deadline = time.monotonic() + a.timeout
    while not os.path.exists(finish):
        if time.monotonic() > deadline:
            return 7
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
