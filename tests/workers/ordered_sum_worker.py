"""One rank of the ordered all-reduce tests (real gloo, the runtime's own process group).

Started by ``tests/test_ordered_sum.py`` as ``python -m tests.workers.ordered_sum_worker
'<json config>'``. It binds the runtime's owned group (``recovery.process_group.training_groups``)
with
``ordered`` as ``recovery.ordered_allreduce`` and writes to ``<out>/rank<r>.json``:

- ``exact``: for each case, whether the all-reduce equals every rank's tensor added in
  rank order (each rank draws every rank's tensor from the same seeds);
- ``layouts_agree``: whether two buffers holding the same values in two orders (two
  bucket layouts) reduce to the same values;
- ``bytes_per_allreduce``: what this process wrote to its sockets per all-reduce of
  ``bytes_numel`` float32 (``/proc/self/io``'s ``wchar``), and ``ordered_sums``.

Config keys: rank, world_size, out, port, ordered, bytes_numel, abort (rank 0 declares a
failure while the others wait on an all-reduce that the last rank never issues).
"""

from __future__ import annotations

import json
import sys
import threading
import time

import torch
import torch.distributed as dist

from recovery.process_group import controller, training_groups
from tests.helpers.mp import tcp_store, write_result

CASES = [(7,), (64,), (1000, 3), (4096,), (3, 5, 7)]


def _wchar() -> int:
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["wchar"])


def _tensors(case: int, shape: tuple[int, ...], world: int) -> list[torch.Tensor]:
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(1000 * case + r)
        out.append(torch.randn(shape, generator=g) * (10.0 ** (r % 3)))
    return out


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rank, world = cfg["rank"], cfg["world_size"]
    torch.set_num_threads(1)
    store = tcp_store(cfg["port"], is_master=rank == 0)
    training_groups.setup_training_group(store, 0, rank, world, 30.0, "gloo",
                                        ordered_allreduce=cfg["ordered"])
    result: dict = {"rank": rank}
    if cfg.get("abort"):
        t = torch.ones(1000)
        if rank == world - 1:
            time.sleep(6)  # never issues it
        # Each waiting rank declares the failure, as every rank's watchdog does.
        declared: list[float] = []

        def declare() -> None:
            declared.append(time.monotonic())
            training_groups.fail_training_groups("test abort")

        threading.Timer(1.0, declare).start()
        t0 = time.monotonic()
        try:
            dist.all_reduce(t)
            result["error"] = None
        except Exception as exc:  # the failure, raised in the waiting caller
            result["error"] = f"{type(exc).__name__}: {exc}"
        ended = time.monotonic()
        result["waited_s"] = ended - t0
        result["after_declared_s"] = ended - declared[0] if declared else None
        write_result(cfg["out"], rank, result)
        return
    exact = []
    for i, shape in enumerate(CASES):
        tensors = _tensors(i, shape, world)
        expected = tensors[0].clone()
        for t in tensors[1:]:
            expected.add_(t)
        mine = tensors[rank].clone()
        work = dist.all_reduce(mine, async_op=True)
        flag = torch.tensor([rank], dtype=torch.int64)
        dist.broadcast(flag, 0)  # another collective issued while the sum is in flight
        work.wait()
        exact.append(bool(torch.equal(mine, expected)) and int(flag) == 0)
    a, b = _tensors(50, (300,), world)[rank], _tensors(51, (200,), world)[rank]
    one, two = torch.cat([a, b]), torch.cat([b, a])
    dist.all_reduce(one)
    dist.all_reduce(two)
    result["layouts_agree"] = bool(torch.equal(one, torch.cat([two[200:], two[:200]])))
    result["exact"] = exact
    big = torch.ones(cfg["bytes_numel"])
    dist.all_reduce(big)
    before = _wchar()
    for _ in range(4):
        dist.all_reduce(big)
    result["bytes_per_allreduce"] = (_wchar() - before) / 4
    result["ordered_sums"] = controller.controller().ordered_sums
    dist.barrier()
    write_result(cfg["out"], rank, result)


if __name__ == "__main__":
    main()
