"""The user's FSDP2, unchanged (``examples/train_fsdp2.py``: ``init_process_group``,
``init_device_mesh``, ``fully_shard`` per block and on the root), trained end to end
under ``checkpointless run`` on 2 nodes x 2 workers (gloo on CPU).

Failure-free runs on a 1-D and a 2-D (replicate x shard) mesh pass. Recovery does not
yet: a kill inside FSDP2's reduce-scatter is detected at once, but the survivors' FSDP2
state from the interrupted backward is not reset, so the run stalls for the collective
timeout and ends not bit-identical (a strict xfail that documents it).
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


@pytest.mark.xfail(strict=True, reason=(
    "not done yet: a survivor's FSDP2 modules keep the state of the interrupted backward "
    "(unsharded parameters, pending reduce-scatter state), so the first collective after "
    "the recovery is not the replacement's, waits the collective timeout, and the run "
    "ends not bit-identical. Needs an FSDP2 reset like reset_ddp_modules (README)."))
def test_fsdp2_survives_a_kill_in_its_reduce_scatter(tmp_path, references):
    job = run_job(tmp_path / "run", nnodes=2, nproc=2, script=SCRIPT, script_args=_args("1d"),
                  overrides=(*SETTINGS[:2], "recovery.collective_timeout_s=10",
                             "recovery.fault=1:6:backward:sigkill"), timeout_s=240)
    assert_succeeded(job)
    assert_noticed_fast(job, victim=1)
    assert not [e for e in job.events("recovery") if e["gen"] > 1], "a second recovery"
    assert_same_final(references["1d"], job)
