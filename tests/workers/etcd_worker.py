"""One rank of tests/test_etcd_store.py: real processes on a real etcd member.

``mode`` "gloo": a gloo group whose rendezvous runs through ``PrefixStore`` on an
:class:`~recovery.job_store.etcd_store.EtcdStore`, one all_reduce. ``mode`` "add": ``adds``
increments of one shared counter, racing the other ranks.
"""

from __future__ import annotations

import datetime
import json
import sys
import time

import psutil
import torch
import torch.distributed as dist

from recovery.job_store.etcd_store import EtcdStore
from tests.helpers.mp import write_result

STARTED = psutil.Process().create_time()


def _progress(what: str) -> None:
    """Where this rank is, in its log: a run killed by the harness shows how far it got."""
    print(f"{time.time() - STARTED:7.2f}s after start: {what}", flush=True)


def main(cfg: dict) -> None:
    rank, world = cfg["rank"], cfg["world_size"]
    _progress("imported")
    store = EtcdStore(cfg["endpoints"], cfg["prefix"], datetime.timedelta(seconds=30))
    _progress("store connected")
    if cfg["mode"] == "gloo":
        dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=30))
        _progress("gloo group ready")
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        dist.barrier()
        dist.destroy_process_group()
        write_result(cfg["out"], rank, {"sum": t.item()})
    else:
        seen = [store.add("counter", 1) for _ in range(cfg["adds"])]
        write_result(cfg["out"], rank, {"seen": seen})


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
