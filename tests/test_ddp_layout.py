"""Bit-identity at 4 and 6 ranks from the kept bucket layout, not an ordered sum (ADR 0034).

Real processes under the real launcher (2 nodes x 2 and 3 nodes x 2 workers, gloo on
CPU), the DDP loop as the PyTorch docs write it, default settings: gloo's own ring
all-reduce reduces every gradient. A SIGKILL in DDP's all-reduce, in a snapshot's capture
or in a replication round must end bit-identical to the failure-free run, with:

- every step's gradients reduced over the same DDP bucket layout as in the failure-free
  run, replayed steps included (read from torch's reducer after each backward: without
  the layout carried with the state, the first step after a recovery reduces over
  DDP's construction layout, and the final weights differ in their last bits);
- no all-reduce summed in rank order (the runtime counts them).
"""

from __future__ import annotations

import pytest

from tests.recovery_harness import assert_same_final, assert_succeeded, run_job

pytestmark = pytest.mark.timeout(300)

SCRIPT = "tests/launcher_scripts/ddp_user_loop.py"
STEPS = 28
FAULT_STEP = 18  # step 8 committed by then: auto snapshots every 8 steps while it measures
SETTINGS = ("recovery.heartbeat_timeout_s=3", "recovery.heartbeat_interval_s=0.5")
WORLDS = {
    # nodes: the DDP's bucket cap (MB). 4 ranks: DDP's default (one bucket, whose
    # parameter order the rebuild reverses); 6 ranks: several buckets.
    2: None,
    3: 0.02,
}


def _args(nodes: int) -> tuple[str, ...]:
    cap = WORLDS[nodes]
    return ("--steps", str(STEPS), "--record-layouts",
            *(("--bucket-cap-mb", str(cap)) if cap is not None else ()))


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """nodes -> the failure-free run at that size (each run once, when first needed)."""
    made = {}

    def get(nodes: int):
        if nodes not in made:
            job = run_job(tmp_path_factory.mktemp(f"layout_reference_{nodes}"), nnodes=nodes,
                          script=SCRIPT, script_args=_args(nodes), overrides=SETTINGS,
                          timeout_s=200)
            assert_succeeded(job)
            assert not job.events("recovery")
            layouts = job.finals()[0]["layouts"]
            first, later = layouts["1"], layouts[str(STEPS)]
            assert first != later, (
                "DDP's rebuilt layout equals its construction layout here: this test "
                f"could not tell a kept layout from a lost one ({first})")
            made[nodes] = job
        return made[nodes]
    return get


def _assert_same_layouts(reference, job) -> None:
    ref, got = reference.finals(), job.finals()
    for rank in sorted(ref):
        # A replacement records the steps it ran: from the target step on.
        assert str(STEPS) in got[rank]["layouts"], got[rank]["layouts"].keys()
        for step in sorted(got[rank]["layouts"], key=int):
            assert got[rank]["layouts"][step] == ref[rank]["layouts"][step], (
                f"rank {rank}, step {step}: gradients reduced over bucket layout "
                f"{got[rank]['layouts'][step]}, the failure-free run over "
                f"{ref[rank]['layouts'][step]}")


# The phases whose recovery meets the layout differently: inside DDP's all-reduce, inside
# the capture that runs DDP's pending rebuild, inside a replication round. A kill in the
# forward, before the step and in the optimizer, at 4 ranks with the same default
# settings, ends bit-identical in tests/test_owned_group.py.
CASES = [(nodes, phase) for nodes in (2, 3) for phase in ("backward", "snapshot",
                                                           "replication")]


@pytest.mark.parametrize(("nodes", "phase"), CASES,
                         ids=[f"{2 * n}ranks-{p}" for n, p in CASES])
def test_a_kill_keeps_the_bucket_layout_and_the_bits(tmp_path, references, nodes, phase):
    ref = references(nodes)
    world = 2 * nodes
    victim = world - 1 if phase in ("backward", "replication") else 1
    job = run_job(tmp_path / "run", nnodes=nodes, script=SCRIPT, script_args=_args(nodes),
                  overrides=(*SETTINGS, f"recovery.fault={victim}:{FAULT_STEP}:{phase}:sigkill"),
                  timeout_s=200)
    assert_succeeded(job)
    targets = {e["target_step"] for e in job.events("recovery")}
    assert targets and min(targets) >= 1, (
        f"recovered to step(s) {targets}: a rollback to step 0 replays DDP's construction "
        "layout and would not test the kept one")
    _assert_same_layouts(ref, job)
    assert_same_final(ref, job)
    assert all(e["ordered_sums"] == 0 for e in job.events("recovery"))
    for rank, final in job.finals().items():
        assert final["ordered_sums"] == 0, (
            f"rank {rank} summed {final['ordered_sums']} all-reduces in rank order: "
            "bit-identity came from the ordered path, not the kept layout")


def test_the_opt_in_ordered_sum_survives_a_kill_bit_identical(tmp_path):
    """``recovery.ordered_allreduce=true``: DDP's buckets summed in rank order on the
    ordered lane (rebuilt with each generation), a kill in the backward while sums are
    in flight, the same bits as the failure-free run with the same setting."""
    nodes, ordered = 3, ("recovery.ordered_allreduce=true",)
    ref = run_job(tmp_path / "reference", nnodes=nodes, script=SCRIPT, script_args=_args(nodes),
                  overrides=(*SETTINGS, *ordered), timeout_s=200)
    assert_succeeded(ref)
    job = run_job(tmp_path / "run", nnodes=nodes, script=SCRIPT, script_args=_args(nodes),
                  overrides=(*SETTINGS, *ordered,
                             f"recovery.fault=5:{FAULT_STEP}:backward:sigkill"), timeout_s=200)
    assert_succeeded(job)
    assert job.events("recovery")
    assert_same_final(ref, job)
    assert all(f["ordered_sums"] > 0 for f in job.finals().values())
