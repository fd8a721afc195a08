"""The opt-in ordered all-reduce (``recovery.ordered_allreduce``; ADR 0034).

Real processes, real gloo, the runtime's own process group, 3 and 5 ranks: every
element is the ranks' values added in rank order (exactly, for odd sizes and shapes,
with another collective issued while the sum is in flight), the result does not depend
on the buffer's layout, each rank sends what a ring sends (measured on its sockets),
and a failure declared while a rank waits on a sum ends the wait at once.
"""

from __future__ import annotations

import pytest

from tests.helpers.mp import free_port, run_workers

WORKER = "tests.workers.ordered_sum_worker"
NUMEL = 1 << 20  # 4 MB of float32: headers are noise


@pytest.mark.parametrize("world", [3, 5])
def test_the_ordered_sum_adds_in_rank_order_at_a_rings_traffic(tmp_path, world):
    run = run_workers(WORKER, world, {"port": free_port(), "ordered": True,
                                      "bytes_numel": NUMEL}, tmp_path, timeout_s=90)
    assert not run.timed_out and sorted(run.results) == list(range(world)), run.describe()
    ring = 2 * (world - 1) / world * NUMEL * 4
    for rank, res in run.results.items():
        assert all(res["exact"]), (rank, res["exact"], run.describe())
        assert res["layouts_agree"], rank
        assert res["ordered_sums"] >= 7, res  # every float sum above took the ordered path
        ratio = res["bytes_per_allreduce"] / ring
        assert ratio <= 1.1, f"rank {rank} sent {ratio:.3f}x a ring's bytes"


def test_gloos_own_sum_depends_on_the_layout(tmp_path):
    """The control: without the ordered path (the default), a ring's sum of the same
    values in another buffer order differs in its last bits somewhere, which is why
    DDP's layout is carried with the state. The bytes are a ring's too."""
    world = 5
    run = run_workers(WORKER, world, {"port": free_port(), "ordered": False,
                                      "bytes_numel": NUMEL}, tmp_path, timeout_s=90)
    assert not run.timed_out and sorted(run.results) == list(range(world)), run.describe()
    assert not all(res["layouts_agree"] for res in run.results.values())
    assert all(res["ordered_sums"] == 0 for res in run.results.values())
    ring = 2 * (world - 1) / world * NUMEL * 4
    assert all(res["bytes_per_allreduce"] / ring <= 1.1 for res in run.results.values())


def test_a_failure_ends_a_pending_ordered_sum_at_once(tmp_path):
    """The waiting ranks' sum ends when the failure is declared (1 s in), long before the
    last rank would have issued it (6 s in) and before the group's 30 s timeout. The
    bound is on the time from each rank's own declaration to the raise, so a loaded
    host's slow start (three interpreters importing torch) is not counted; the harness's
    limit only catches a hang."""
    world = 3
    run = run_workers(WORKER, world, {"port": free_port(), "ordered": True, "abort": True,
                                      "bytes_numel": 0}, tmp_path, timeout_s=120)
    for rank in range(world - 1):  # the last rank sleeps, then meets an aborted group
        res = run.results.get(rank)
        assert res is not None, run.describe()
        assert res["error"] and "aborted" in res["error"], res
        assert res["after_declared_s"] is not None and res["after_declared_s"] < 2.0, res
        assert res["waited_s"] < 5.0 + res["after_declared_s"], res
