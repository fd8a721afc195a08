"""Live rollback (ADR 0039): a data-parallel job goes on from the step it was in.

The rule's parts are checked on their own (which entries a mark holds, when the live
state is still a step's end, what the planner upgrades), then on real jobs under the
launcher: a SIGKILLed rank (``recovery.fault``) in an all-reduce loop and in a DDP loop
as the PyTorch tutorial writes it, each against a run without failures (weights,
optimizer state, data order and position bit-identical), with the plan's target
asserted; and the cases that must fall back to the committed snapshot and replay.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from recovery.generation.protocol import JoinRecord
from recovery.generation.rendezvous import RecoveryPlan, choose_plan
from replication.replica_protocol.marks import Mark, MarkBook, large_entries
from replication.snapshots.checksum import ChecksumMismatch
from replication.training_state.state import TrainingState
from tests import recovery_harness as h

# -- which entries a mark holds ---------------------------------------------------------------


def _job(dp: bool = True) -> tuple[TrainingState, dict[str, Any]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5),
                                torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    state = TrainingState()
    for name, obj in (("model", model), ("optimizer", opt), ("scheduler", sched)):
        state.register(name, obj)
    return state, {"model": model, "opt": opt, "sched": sched}


def _train(objs: dict[str, Any], scheduler: bool = True) -> None:
    objs["model"](torch.randn(4, 8)).sum().backward()
    objs["opt"].step()
    objs["opt"].zero_grad()
    if scheduler:
        objs["sched"].step()


def test_a_data_parallel_model_and_its_optimizer_are_left_out_of_marks():
    state, _ = _job()
    assert large_entries(state, {"model"}) == ["model", "optimizer"]


def test_a_job_with_a_module_that_is_not_data_parallel_has_no_marks():
    state, _ = _job()
    assert large_entries(state, set()) is None  # nothing declared (FSDP2, a sharded job)
    state.register("head", torch.nn.Linear(2, 2))  # a second, undeclared module
    assert large_entries(state, {"model"}) is None


def test_an_optimizer_over_parameters_outside_the_data_parallel_model_means_no_marks():
    state, objs = _job()
    extra = torch.nn.Parameter(torch.zeros(3))
    objs["opt"].add_param_group({"params": [extra]})
    assert large_entries(state, {"model"}) is None


def test_the_live_state_is_the_marked_step_until_the_optimizer_changes_it():
    state, objs = _job()
    book = MarkBook(state)
    book.declare({"model"})
    _train(objs)  # Adam's state tensors exist from here on
    book.capture(7)
    assert book.live_step() == 7
    objs["model"](torch.randn(4, 8)).sum().backward()  # the next step's forward, backward
    assert book.live_step() == 7  # gradients are not the model's state
    objs["opt"].step()
    assert book.live_step() == -1


def test_a_scheduler_that_changed_the_learning_rate_alone_is_caught():
    state, objs = _job()
    book = MarkBook(state)
    book.declare({"model"})
    _train(objs)
    book.capture(3)
    objs["sched"].step()  # no tensor of the model or optimizer changes, the lr does
    assert book.live_step() == -1


def test_batch_norm_statistics_moved_by_the_next_forward_come_back_from_the_mark():
    """Buffers are not versioned (DDP rewrites them in every forward): the mark holds
    them by value, so a live rollback puts them back as they were."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainingState()
    state.register("model", model)
    state.register("optimizer", opt)
    book = MarkBook(state)
    book.declare({"model"})
    mark = book.capture(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.randn(8, 4))  # running statistics move in the forward pass
    assert book.live_step() == 1
    assert not torch.equal(model[1].running_mean, before["1.running_mean"])
    book.restore_small(mark)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_mark_puts_back_the_rng_and_scheduler_the_next_step_moved():
    state, objs = _job()
    book = MarkBook(state)
    book.declare({"model"})
    _train(objs)
    mark = book.capture(5)
    expected, last = torch.rand(3), objs["sched"].last_epoch  # the next step's first draw
    objs["sched"].step()
    torch.rand(100)  # the failed step's draws
    book.restore_small(Mark.from_tensor(mark.to_tensor()))  # as its holder received it
    assert torch.equal(torch.rand(3), expected) and objs["sched"].last_epoch == last


def test_a_damaged_mark_is_refused_before_anything_is_loaded():
    state, objs = _job()
    book = MarkBook(state)
    book.declare({"model"})
    mark = book.capture(1)
    data = mark.to_tensor()
    data[-1] ^= 0xFF
    last_epoch = objs["sched"].last_epoch
    with pytest.raises(ChecksumMismatch):
        book.restore_small(Mark.from_tensor(data))
    assert objs["sched"].last_epoch == last_epoch


# -- the planner's rule -----------------------------------------------------------------------


def _rec(rank: int, *, live: int = -1, marks: dict[int, int] | None = None,
         newcomer: bool = False) -> JoinRecord:
    """Rank ``rank`` of 3 on its own node, holding step 8 and the replica of the next."""
    return JoinRecord(rank=rank, node=rank, pid=100 + rank, newcomer=newcomer,
                      local_steps=[] if newcomer else [0, 8],
                      replicas={} if newcomer else {str((rank + 1) % 3): [0, 8]},
                      committed=-1 if newcomer else 8, live_step=live,
                      marks={str(k): v for k, v in (marks or {}).items()})


def test_the_plan_goes_on_from_the_survivors_live_step_with_the_newcomers_mark():
    records = {0: _rec(0, live=11, marks={1: 11}), 1: _rec(1, newcomer=True),
               2: _rec(2, live=11, marks={0: 11})}
    plan = choose_plan(3, 8, records)
    assert plan == RecoveryPlan(3, 11, {1: 0}, live=True, base_step=8)


@pytest.mark.parametrize("survivors, why", [
    ({0: dict(live=11, marks={1: 10}), 2: dict(live=11)}, "the newcomer's mark is older"),
    ({0: dict(live=11, marks={1: 11}), 2: dict(live=-1)}, "a survivor's model moved on"),
    ({0: dict(live=11, marks={1: 11}), 2: dict(live=12)}, "survivors at different steps"),
    ({0: dict(live=8, marks={1: 8}), 2: dict(live=8)}, "nothing to gain over step 8"),
])
def test_anything_less_is_the_snapshot_plan(survivors: dict[int, dict], why: str):
    records = {r: _rec(r, **kw) for r, kw in survivors.items()}
    records[1] = _rec(1, newcomer=True)
    plan = choose_plan(3, 8, records)
    assert (plan.live, plan.target_step, plan.providers) == (False, 8, {1: 0}), why


# -- real jobs ------------------------------------------------------------------------------

ARGS = ("--steps", "20", "--dim", "32", "--layers", "1", "--batch", "4", "--seq-len", "16")


def _pair(tmp_path: Path, script: str, overrides: tuple[str, ...], fault: str
          ) -> tuple[h.JobResult, h.JobResult]:
    ref = h.run_job(tmp_path / "reference", nproc=2, spares=1, overrides=overrides,
                    script=script, script_args=ARGS)
    h.assert_succeeded(ref)
    job = h.run_job(tmp_path / "killed", nproc=2, spares=1, script=script, script_args=ARGS,
                    overrides=(*overrides, f"recovery.fault={fault}"))
    h.assert_succeeded(job)
    h.assert_same_final(ref, job)  # weights, optimizer state, data order and position
    return ref, job


def _targets(job: h.JobResult) -> set[tuple[int, bool]]:
    """Each recovery's (target, live); printed with what each rank's join record said,
    so a failed assertion shows why a plan was not live."""
    rows = h.recovery_events(job)
    print([{k: e.get(k) for k in ("rank", "gen", "target_step", "live", "live_step",
                                  "marks_held", "newcomer")} for e in rows])
    return {(int(e["target_step"]), bool(e["live"])) for e in rows}


def test_a_kill_mid_interval_goes_on_from_the_step_before_it(tmp_path):
    """Snapshots every 8 steps, rank 1 SIGKILLed in step 11's backward: without live
    rollback the job would go back to step 8 and replay 9 and 10. Whether step 8's
    round has committed by the kill depends on the host's load; the capture-ahead
    assertion follows whichever base the plan reports, instead of assuming an idle host."""
    _, job = _pair(tmp_path, h.SCRIPT, ("replication.every_n_steps=8",), "1:11:backward")
    assert _targets(job) == {(10, True)}
    # the replacement runs on the survivor's host: it read the model and optimizer from
    # the survivor's snapshot slot in shared memory; only its mark crossed the channel
    newcomer = _newcomer(job)
    assert "map_s" in newcomer["transfer_parts"], newcomer["transfer_parts"]
    assert "receive_s" not in newcomer["transfer_parts"]
    # 8 unless its round was still running when the kill came (then 0, and its
    # snapshot is dropped: no durable save is due at it in this job)
    bases = {int(e["base_step"]) for e in h.recovery_events(job)}
    assert bases in ({0}, {8}), bases
    # With step 8 committed, the survivor captured step 10 while the rendezvous waited
    # for the replacement. With step 8's round still running, its slot is newer than the
    # committed step and the capture ahead does not take it (ADR 0041): step 10 is then
    # captured after the plan. Which of the two happens is the host's timing.
    survivor = next(e for e in h.recovery_events(job) if not e.get("newcomer"))
    if bases == {8}:
        assert "capture_ahead_s" in survivor["transfer_parts"], survivor["transfer_parts"]


def _newcomer(job: h.JobResult) -> dict:
    return next(e for e in h.recovery_events(job) if e.get("newcomer"))


def test_without_the_same_host_path_the_live_state_crosses_the_channel(tmp_path):
    """``replication.same_host_handover=false`` (what a replacement on another node
    gets): every byte of the model and optimizer is sent, and the result is the same."""
    _, job = _pair(tmp_path, h.SCRIPT, ("replication.every_n_steps=8",
                                        "replication.same_host_handover=false"),
                   "1:11:backward")
    assert _targets(job) == {(10, True)}
    parts = _newcomer(job)["transfer_parts"]
    assert "receive_s" in parts and "map_s" not in parts, parts


def test_ddp_as_the_tutorial_writes_it_goes_on_from_the_step_before_the_kill(tmp_path):
    _, job = _pair(tmp_path, "examples/train_ddp.py", ("replication.every_n_steps=8",),
                   "1:11:backward")
    assert _targets(job) == {(10, True)}


def test_the_k_minus_1_race_never_replays_k_minus_1(tmp_path):
    """Every step snapshotted, rank 1 killed in step 9's backward, while step 8's round
    may or may not have committed (the race that made a kill replay K-1): the job goes
    on from step 8 either way, from its snapshot or live."""
    _, job = _pair(tmp_path, h.SCRIPT, ("replication.every_n_steps=1",), "1:9:backward")
    assert {target for target, _ in _targets(job)} == {8}


def test_a_rank_lost_before_its_mark_left_falls_back_to_the_snapshot(tmp_path):
    """Rank 1 dies as it snapshots step 16, after the step: the survivor finishes step
    16 and marks it, but holds rank 1's mark of step 15 only, so the job goes back to
    step 8 (16's round never committed) and replays."""
    _, job = _pair(tmp_path, h.SCRIPT, ("replication.every_n_steps=8",), "1:16:snapshot")
    assert _targets(job) == {(8, False)}  # 16's capture waited for 8's commit


def test_turned_off_it_replays_from_the_snapshot(tmp_path):
    _, job = _pair(tmp_path, h.SCRIPT, ("replication.every_n_steps=8",
                                        "recovery.live_rollback=false"), "1:11:backward")
    assert _targets(job) <= {(8, False), (0, False)}  # 0: step 8's round still running


def test_the_durable_saves_are_those_of_a_run_without_failures(tmp_path):
    """Saves every 8 steps, snapshots every 4: the kill in step 11 goes on live from
    step 10, whose snapshot (taken in the recovery) is not a save, so the run saves
    steps 8 and 16 (and the last), as the run without failures does."""
    def saves(job: h.JobResult) -> list[int]:
        return sorted(int(e["step"]) for e in job.events("durable_save") if e["rank"] == 0)

    overrides = ("replication.every_n_steps=4", "persistence.every_n_steps=8")
    ref, job = (
        h.run_job(tmp_path / name, nproc=2, spares=1, script_args=ARGS,
                  overrides=(*overrides, f"persistence.path={tmp_path / name / 'ckpt'}",
                             *extra))
        for name, extra in (("reference", ()), ("killed", ("recovery.fault=1:11:backward",))))
    h.assert_succeeded(ref)
    h.assert_succeeded(job)
    h.assert_same_final(ref, job)
    # Live from 10, unless step 8's save was still waiting for its writer when the kill
    # came (its round ended late on a loaded host): then the snapshot path, by the rule,
    # to the committed step: 8, or 4 when 8's round had not committed yet either (seen
    # once under -n 2 on the 2-core host). Whichever, the saves below must not change.
    assert _targets(job) in ({(10, True)}, {(8, False)}, {(4, False)})
    assert saves(job) == saves(ref) == [8, 16, 20], (saves(ref), saves(job))
