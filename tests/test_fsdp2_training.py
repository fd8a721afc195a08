"""The user's FSDP2, unchanged (``examples/train_fsdp2.py``: ``init_process_group``,
``init_device_mesh``, ``fully_shard`` per block and on the root), trained end to end
under ``checkpointless run`` on 2 nodes x 2 workers (gloo on CPU).

Failure-free runs on a 1-D and a 2-D (replicate x shard) mesh, then a worker killed in
each phase of a step (all-gather in forward, reduce-scatter in backward, optimizer) on
either node, and a whole node lost: every recovered run ends bit-identical to the
failure-free one, and the survivors notice the kill within a few heartbeats.
"""

from __future__ import annotations

import pytest

from tests.recovery_harness import (
    assert_noticed_fast,
    assert_same_final,
    assert_succeeded,
    run_job,
)

pytestmark = pytest.mark.timeout(400)

SCRIPT = "examples/train_fsdp2.py"
STEPS = 14
SETTINGS = ("recovery.heartbeat_timeout_s=3", "recovery.heartbeat_interval_s=0.5",
            "recovery.collective_timeout_s=60")


def _args(mesh: str) -> tuple[str, ...]:
    return ("--steps", str(STEPS), "--dim", "32", "--layers", "2", "--mesh", mesh)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    out = {}
    for mesh in ("1d", "2d"):
        job = run_job(tmp_path_factory.mktemp(f"fsdp2_ref_{mesh}"), nnodes=2, nproc=2,
                      script=SCRIPT, script_args=_args(mesh), overrides=SETTINGS,
                      timeout_s=240)
        assert_succeeded(job)
        assert not job.events("recovery"), "the reference run recovered from something"
        finals = job.finals()
        assert sorted(finals) == [0, 1, 2, 3] and {f["step"] for f in finals.values()} == {STEPS}
        # 1-D: four different shards; 2-D: two shards, each replicated on two ranks
        assert len({f["digest"] for f in finals.values()}) == (4 if mesh == "1d" else 2)
        out[mesh] = job
    return out


def test_fsdp2_trains_unchanged_under_the_launcher(references):
    """Failure-free, 1-D and 2-D meshes: the fixture's checks (every rank finished every
    step, shards differ across the shard dimension) are the test."""
    assert set(references) == {"1d", "2d"}


@pytest.mark.parametrize("mesh,fault", [
    ("1d", "1:6:backward:sigkill"),    # inside FSDP2's reduce-scatter, the other node
    ("1d", "0:5:forward:sigkill"),     # inside an all-gather, the store host's rank
    ("1d", "2:7:optimizer:sigkill"),   # after the reduce-scatters, node 1
    ("2d", "3:6:backward:sigkill"),    # HSDP: reduce-scatter then the replicate all-reduce
])
def test_fsdp2_survives_a_kill(tmp_path, references, mesh, fault):
    """A worker SIGKILLed mid-step: the survivors' FSDP2 modules are reset to the start
    of an iteration (``reset_iter_state``), the replacement receives its own shards from
    the other node, and the run ends bit-identical to the failure-free one."""
    job = run_job(tmp_path / "run", nnodes=2, nproc=2, script=SCRIPT, script_args=_args(mesh),
                  overrides=(*SETTINGS[:2], "recovery.collective_timeout_s=30",
                             f"recovery.fault={fault}"), timeout_s=240)
    assert_succeeded(job)
    victim = int(fault.split(":")[0])
    assert_noticed_fast(job, victim=victim)
    recs = job.events("recovery")
    assert recs and not [e for e in recs if e["gen"] > 1], "a second recovery"
    survivors = [e for e in recs if not e["newcomer"]]
    assert survivors and all(e["fsdp_modules_reset"] == 1 for e in survivors), survivors
    # Default settings: bit-identity without summing anything in rank order (ADR 0034).
    assert all(e["ordered_sums"] == 0 for e in recs), recs
    assert_same_final(references[mesh], job)


@pytest.mark.slow
def test_fsdp2_survives_the_loss_of_a_node(tmp_path, references):
    """Node 1 (its agent and ranks 2, 3) dies mid-backward; a spare node takes over and
    both lost ranks receive their shards from node 0."""
    job = run_job(tmp_path / "run", nnodes=2, nproc=2, spare_nodes=1, script=SCRIPT,
                  script_args=_args("1d"),
                  overrides=(*SETTINGS[:2], "recovery.collective_timeout_s=30",
                             "recovery.fault=2:6:backward:node"), timeout_s=240)
    assert job.returncodes[1] == -9, f"node 1's agent should be SIGKILLed: {job.returncodes}"
    assert_succeeded(job, except_nodes=(1,))
    recs = job.events("recovery")
    newest = [e for e in recs if e["gen"] == max(r["gen"] for r in recs)]
    assert {e["rank"] for e in newest if e["newcomer"]} == {2, 3}, recs
    assert_same_final(references["1d"], job)
