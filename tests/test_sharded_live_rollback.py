"""Sharded jobs go on from the live step (ADR 0049): a replacement rebuilds its shard
from its replica of the committed step and the optimizer inputs logged since.

The parts first: an optimizer replayed on logged gradients and hyperparameters gives
the bits of the run it was logged from (AdamW with and without ``foreach``, a
scheduler that changes ``lr`` every step, clipping before the step); which jobs can be
logged; the holder's runs of marks (gaps, commits, the memory bound); the planner's
rule; the snapshot interval capped by what the holders can keep. Then the user's own
FSDP2 script (``examples/train_fsdp2.py``, 2 nodes x 2 ranks, gloo) under the
launcher, killed 1, 5 and 40 steps after its last snapshot, in forward and in
backward, and once right before its optimizer step (the survivors' shards have moved
on: the fallback). Each run ends bit-identical to a run without failures, and the
plan's target, its base and the optimizer steps replayed are asserted.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from recovery.generation.protocol import JoinRecord
from recovery.generation.rendezvous import choose_plan
from recovery.recipe import CheckpointlessConfig
from recovery.schedules.auto_interval import AutoInterval
from replication.replica_protocol.marks import Mark, MarkBook, sharded_entries
from replication.replica_protocol.peer_logs import PeerLogs
from replication.replica_protocol.update_log import UPDATES, UpdateRecorder, replay
from replication.snapshots.digest_copy import verify_segments
from replication.training_state.layout import unflatten_segment
from replication.training_state.snapshot_meta import SnapshotMeta
from replication.training_state.state import TrainingState
from tests import recovery_harness as h

# -- an optimizer replayed on its logged inputs -------------------------------------------


def _objects(foreach: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=foreach)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s) ** 0.5)
    return {"model": model, "optimizer": opt, "scheduler": sched}


def _step(objs: dict[str, Any], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    objs["model"](torch.randn(8, 6, generator=g)).pow(2).mean().backward()
    torch.nn.utils.clip_grad_norm_(objs["model"].parameters(), 0.05)
    objs["optimizer"].step()
    objs["optimizer"].zero_grad()
    objs["scheduler"].step()


@pytest.mark.parametrize("foreach", [False, True])
def test_an_optimizer_replayed_on_its_log_gives_the_same_bits(foreach: bool):
    """Steps 1-3 run, the state is kept; steps 4-9 are logged; a fresh copy loaded with
    the kept state and replayed on the log matches the original exactly: parameters,
    optimizer state (moments, step counts) and the learning rate the scheduler left."""
    live = _objects(foreach)
    for s in range(3):
        _step(live, s)
    kept = {k: _deep(live[k].state_dict()) for k in ("model", "optimizer")}
    recorder = UpdateRecorder({"optimizer": live["optimizer"]})
    logs = []
    for s in range(3, 9):
        _step(live, s)
        logs.append(_deep(recorder.state_dict()))
        recorder.taken()
    fresh = _objects(foreach)
    fresh["model"].load_state_dict(kept["model"])
    fresh["optimizer"].load_state_dict(kept["optimizer"])
    assert replay({"optimizer": fresh["optimizer"]}, logs) == 6
    for a, b in zip(live["model"].parameters(), fresh["model"].parameters()):
        assert torch.equal(a, b)
    sa, sb = live["optimizer"].state_dict(), fresh["optimizer"].state_dict()
    for i in sa["state"]:
        for k in sa["state"][i]:
            assert torch.equal(sa["state"][i][k], sb["state"][i][k]), (i, k)
    assert sa["param_groups"] == sb["param_groups"]  # lr as the scheduler left it
    assert all(p.grad is None for p in fresh["model"].parameters())


def _deep(sd: Any) -> Any:
    """A copy that later steps cannot change (the recorder reuses its buffers)."""
    if torch.is_tensor(sd):
        return sd.clone()
    if isinstance(sd, dict):
        return {k: _deep(v) for k, v in sd.items()}
    if isinstance(sd, (list, tuple)):
        return type(sd)(_deep(v) for v in sd)
    return sd


def test_a_replay_on_the_wrong_parameters_is_refused_before_any_step():
    objs = _objects(False)
    recorder = UpdateRecorder({"optimizer": objs["optimizer"]})
    _step(objs, 0)
    log = _deep(recorder.state_dict())
    log["calls"][0]["grads"] = log["calls"][0]["grads"][:-1]
    with pytest.raises(ValueError, match="the log has 3"):
        replay({"optimizer": _objects(False)["optimizer"]}, [log])


# -- which jobs are logged -----------------------------------------------------------------


def _state(**objs: Any) -> TrainingState:
    state = TrainingState(rng=False)
    for name, obj in objs.items():
        state.register(name, obj)
    return state


def test_a_job_that_is_not_data_parallel_logs_its_optimizers_inputs():
    objs = _objects(False)
    book = MarkBook(_state(**objs))
    book.declare(data_parallel=())
    assert book.sharded and book.large == ["model", "optimizer"]
    _step(objs, 0)
    mark = book.capture(1)
    assert mark is not None and mark.has_updates and mark.replayable
    assert book.live_step() == 1
    objs["model"](torch.randn(2, 6)).sum().backward()  # the next step's forward, backward
    assert book.live_step() == 1
    objs["optimizer"].step()  # its optimizer step has begun: the shards moved on
    assert book.live_step() == -1


def test_a_trainable_module_outside_every_optimizer_is_not_logged():
    """An EMA copy registered as a module changes in place each step, outside any
    optimizer: a replay could not rebuild it, so the job keeps the snapshot path."""
    objs = _objects(False)
    ema = torch.nn.Linear(6, 3)
    large, why = sharded_entries(_state(**objs, ema=ema))
    assert large is None and "'weight' is trainable but in no registered optimizer" in why
    ema.requires_grad_(False)  # frozen: stays as its replica has it
    assert sharded_entries(_state(**objs, ema=ema))[0] == ["model", "ema", "optimizer"]


# -- what a holder keeps -------------------------------------------------------------------


def _mark(step: int, nbytes: int = 100, replayable: bool = True) -> Mark:
    meta = SnapshotMeta.from_bytes(_meta_bytes(step))
    return Mark(step, meta, torch.zeros(nbytes, dtype=torch.uint8), replayable)


def _meta_bytes(step: int) -> bytes:
    objs = _objects(False)
    book = MarkBook(_state(**objs))
    book.declare(())
    mark = book.capture(step)
    assert mark is not None
    return mark.meta.to_bytes()


def test_a_holder_keeps_the_unbroken_run_after_the_committed_step():
    logs = PeerLogs()
    for s in (1, 2, 3):
        logs.append(5, _mark(s))
    assert logs.first_steps() == {5: 1} and [m.step for m in logs.run(5, 2, 3)] == [2, 3]
    logs.append(5, _mark(5))  # mark 4 never arrived: the run starts again
    assert logs.first_steps() == {5: 5}
    with pytest.raises(KeyError, match="from step 1 to 5"):
        logs.run(5, 1, 5)
    logs.append(5, _mark(6, replayable=False))  # one a replay could not use: a gap
    assert logs.first_steps() == {}
    for s in (7, 8, 9):
        logs.append(5, _mark(s))
    logs.committed(8)
    assert logs.first_steps() == {5: 9}
    logs.append(5, _mark(8))  # older than the committed step: useless
    assert logs.first_steps() == {5: 9}


def test_a_run_over_the_memory_bound_is_dropped_until_the_next_commit():
    logs = PeerLogs(max_bytes=350)
    for s in (1, 2, 3):
        logs.append(1, _mark(s))
    assert logs.steps_that_fit() == 1  # three 100-byte marks fit, less two
    logs.append(1, _mark(4))
    assert logs.first_steps() == {} and logs.overflows == 1
    logs.append(1, _mark(5))
    assert logs.first_steps() == {}  # not extended again before a commit
    logs.committed(5)
    logs.append(1, _mark(6))
    assert logs.first_steps() == {1: 6}


def test_the_snapshot_interval_is_capped_at_what_every_holder_can_log():
    """The agreement takes the least of every rank's log capacity (a MAX of negatives):
    the next interval the policy chooses is at most that, and it says so."""
    settings = CheckpointlessConfig()
    events: list[dict] = []
    log = type("Log", (), {"emit": lambda self, *a, **k: events.append(k)})()

    def agree(t: torch.Tensor) -> None:  # another rank's log holds 5 steps at most
        t.copy_(torch.maximum(t, torch.tensor([0, 0, 0, -5])))

    auto = AutoInterval(settings, 1, log, agree)
    auto.log_steps = lambda: 40
    assert auto.policy is not None
    auto._agree(64, None)
    assert auto.policy.max_interval == 5


# -- the planner's rule --------------------------------------------------------------------


def _rec(rank: int, *, live: int = -1, marks: dict[int, int] | None = None,
         logs: dict[int, int] | None = None, replica: int = 8,
         newcomer: bool = False) -> JoinRecord:
    """Rank ``rank`` of 3 on its own node, holding step 8 and the next rank's replica."""
    return JoinRecord(rank=rank, node=rank, pid=100 + rank, newcomer=newcomer,
                      local_steps=[] if newcomer else [0, 8],
                      replicas={} if newcomer else {str((rank + 1) % 3): [0, replica]},
                      committed=-1 if newcomer else 8, live_step=live,
                      marks={str(k): v for k, v in (marks or {}).items()},
                      sharded=not newcomer,
                      logs={str(k): v for k, v in (logs or {}).items()})


def test_the_plan_replays_the_newcomers_log_on_its_replica():
    records = {0: _rec(0, live=11, marks={1: 11}, logs={1: 9}), 1: _rec(1, newcomer=True),
               2: _rec(2, live=11, marks={0: 11}, logs={0: 9})}
    plan = choose_plan(3, 8, records)
    assert (plan.target_step, plan.base_step, plan.live, plan.logged, plan.providers) == \
        (11, 8, True, True, {1: 0})


@pytest.mark.parametrize("holder, why", [
    (dict(live=11, marks={1: 11}, logs={1: 10}), "the log starts after step 9"),
    (dict(live=11, marks={1: 11}, logs={}), "no log at all"),
    (dict(live=11, marks={1: 11}, logs={1: 9}, replica=4), "its log, another's replica"),
])
def test_without_the_whole_log_and_its_base_the_plan_replays_steps(holder: dict, why: str):
    records = {0: _rec(0, **holder), 1: _rec(1, newcomer=True),
               2: _rec(2, live=11, marks={0: 11}, logs={0: 9})}
    records[2].replicas["1"] = [0, 8]  # the snapshot plan's provider of rank 1
    plan = choose_plan(3, 8, records)
    assert (plan.live, plan.target_step) == (False, 8), why
    assert "no survivor holds rank 1's update log from step 9 to 11" in plan.live_refused


# -- the user's FSDP2 script under the launcher -------------------------------------------

SCRIPT = "examples/train_fsdp2.py"
STEPS = 42
SETTINGS = ("recovery.heartbeat_timeout_s=3", "recovery.heartbeat_interval_s=0.5",
            "recovery.collective_timeout_s=30", "replication.every_n_steps=50")
ARGS = ("--steps", str(STEPS), "--dim", "32", "--layers", "2", "--mesh", "1d")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = h.run_job(tmp_path_factory.mktemp("sharded_ref"), nnodes=2, nproc=2, script=SCRIPT,
                    script_args=ARGS, overrides=SETTINGS, timeout_s=240)
    h.assert_succeeded(job)
    assert not job.events("recovery")
    return job


@pytest.mark.timeout(400)
@pytest.mark.parametrize("fault, live", [
    ("1:2:forward:sigkill", 1),     # 1 step after the snapshot of step 0
    ("2:6:backward:sigkill", 5),    # 5 steps after it, inside FSDP2's reduce-scatter
    ("3:41:forward:sigkill", 40),   # 40 steps after it, inside an all-gather
])
def test_a_sharded_job_goes_on_from_the_step_it_was_in(tmp_path, reference, fault, live):
    job = h.run_job(tmp_path / "run", nnodes=2, nproc=2, script=SCRIPT, script_args=ARGS,
                    overrides=(*SETTINGS, f"recovery.fault={fault}"), timeout_s=240)
    h.assert_succeeded(job)
    recs = job.events("recovery")
    print([{k: e.get(k) for k in ("rank", "target_step", "live", "logged", "live_refused",
                                  "logs_held", "newcomer")} for e in recs])
    assert {(e["target_step"], e["base_step"], e["live"], e["logged"]) for e in recs} == \
        {(live, 0, True, True)}
    victim = int(fault.split(":")[0])
    newcomer = [e for e in recs if e["newcomer"]]
    assert [e["rank"] for e in newcomer] == [victim]
    # nothing ran again but the victim's own optimizer steps since the snapshot
    assert newcomer[0]["transfer_parts"]["optimizer_steps_replayed"] == live
    assert all(e["transfer_parts"]["optimizer_steps_replayed"] == 0
               for e in recs if not e["newcomer"])
    h.assert_same_final(reference, job)


@pytest.mark.timeout(400)
def test_a_kill_after_the_survivors_optimizer_step_falls_back_to_the_snapshot(tmp_path,
                                                                             reference):
    """Rank 1 dies as its optimizer step begins; the others' steps have run, so their
    shards are step 7's while rank 1's mark of step 7 was never sent: the plan replays
    from the snapshot of step 0, says why, and the run is still bit-identical."""
    job = h.run_job(tmp_path / "run", nnodes=2, nproc=2, script=SCRIPT, script_args=ARGS,
                    overrides=(*SETTINGS, "recovery.fault=1:7:optimizer:sigkill"),
                    timeout_s=240)
    h.assert_succeeded(job)
    recs = job.events("recovery")
    assert {(e["target_step"], e["live"]) for e in recs} == {(0, False)}
    assert all(e["live_refused"] for e in recs)
    h.assert_same_final(reference, job)


def test_the_marks_carry_the_updates_entry():
    objs = _objects(True)
    book = MarkBook(_state(**objs))
    book.declare(())
    _step(objs, 0)
    mark = book.capture(1)
    assert mark is not None and UPDATES in {s.name for s in mark.meta.layout.segments}


def _grads_seen(objs: dict[str, Any], seed: int) -> list[torch.Tensor]:
    """One step's forward and backward: the gradients its optimizer step will see."""
    g = torch.Generator().manual_seed(seed)
    objs["model"](torch.randn(8, 6, generator=g)).pow(2).mean().backward()
    return [p.grad.clone() for p in objs["model"].parameters()]


def _logged(mark: Mark) -> list[torch.Tensor]:
    """The gradients a mark logged, decoded from its bytes as a holder receives them."""
    held = Mark.from_tensor(mark.to_tensor())
    verify_segments(held.buffer, held.meta)
    seg = held.meta.layout.segment(UPDATES)
    entry = unflatten_segment(held.buffer[seg.offset : seg.offset + seg.nbytes], seg,
                              held.meta.skeletons[UPDATES])
    return [g for call in entry["calls"] for g in call["grads"]]


def test_the_recorder_copies_a_gradient_only_once_something_wrote_it_in_place():
    """A job that zeroes its gradients by dropping them: the recorder keeps the
    optimizer's own gradients and the mark copies them once. One that zeroes them in
    place before the step's end: that mark is refused (the bytes the optimizer saw are
    gone), and from the next step on the recorder copies them as it records them; the
    marks after that log what the optimizer saw."""
    objs = _objects(False)
    book = MarkBook(_state(**objs))
    book.declare(())
    assert book.recorder is not None
    seen = _grads_seen(objs, 0)
    objs["optimizer"].step()
    recorded = book.recorder.calls[0]["grads"]
    assert [g.data_ptr() for g in recorded] == [p.grad.data_ptr()
                                                for p in objs["model"].parameters()]
    objs["optimizer"].zero_grad()  # set to None: the recorded tensors stay as they were
    mark = book.capture(1)
    assert mark is not None and mark.replayable and not book.recorder.copying
    assert all(torch.equal(a, b) for a, b in zip(_logged(mark), seen))

    _grads_seen(objs, 1)
    objs["optimizer"].step()
    objs["optimizer"].zero_grad(set_to_none=False)  # the recorded bytes are zeroed
    mark = book.capture(2)
    assert mark is not None and not mark.replayable and book.recorder.copying

    seen = _grads_seen(objs, 2)
    objs["optimizer"].step()
    objs["optimizer"].zero_grad(set_to_none=False)
    mark = book.capture(3)
    assert mark is not None and mark.replayable
    assert all(torch.equal(a, b) for a, b in zip(_logged(mark), seen))


def test_a_mark_captured_into_its_message_is_read_back_from_it():
    """The mark's bytes are written where its message carries them (no copy after the
    capture), on a boundary every dtype's view needs, and the message as a holder
    receives it gives the same mark."""
    objs = _objects(True)
    book = MarkBook(_state(**objs))
    book.declare(())
    _step(objs, 0)
    message = torch.zeros(1 << 20, dtype=torch.uint8)
    asked: list[int] = []

    def into(n: int) -> torch.Tensor:
        asked.append(n)
        return message[64 : 64 + n]

    mark = book.capture(1, into=into)
    assert mark is not None and asked == [mark.to_tensor().numel()]
    raw = mark.meta.to_bytes()
    assert mark.lies_in(message[64:], raw) and mark.buffer.data_ptr() % 64 == 0
    held = Mark.from_tensor(message[64 : 64 + asked[0]], copy=False)
    assert held.meta.to_bytes() == raw and torch.equal(held.buffer, mark.buffer)
    book.restore_small(held)  # verified against its checksums, then loaded


# -- the memory bound forces a snapshot ---------------------------------------------------

#: Room for this job's snapshot slots and replicas (2 x 254.5 KiB each, as the budget
#: check reports it) and about 250 KB of update log: six marks of 37-41 KB, so the
#: holders can keep 4 steps (less two for the round in flight) and the default
#: interval's agreement caps it there.
TIGHT_BUDGET = 1018 * 1024 + 260_000
AUTO_STEPS = 90
AUTO_ARGS = ("--steps", str(AUTO_STEPS), "--dim", "32", "--layers", "2", "--mesh", "1d")
AUTO_SETTINGS = (*SETTINGS[:3], "replication.every_n_steps=auto",
                 f"memory.host_budget_bytes={TIGHT_BUDGET}")


def _capped_interval(job: h.JobResult) -> int:
    """The interval every rank put in force at the first agreement (step 64), which
    must be the update logs' bound, not a cost's."""
    chosen = [e for e in job.events("auto_interval") if e.get("tier") == "replication"]
    assert {e["rank"] for e in chosen} == {0, 1, 2, 3}, chosen
    steps = {e["every_n_steps"] for e in chosen}
    assert len(steps) == 1, chosen
    k = steps.pop()
    assert 1 < k < 8, f"the probe's 8 steps were not capped: {chosen}"
    assert all(any(r.startswith(f"capped at {k} steps: the update logs") for r in e["reasons"])
               for e in chosen), chosen
    return k


@pytest.mark.timeout(600)
def test_the_memory_bound_forces_a_snapshot_before_the_log_overflows(tmp_path):
    """With a budget that holds a few steps of log, the default interval is capped
    there at its first agreement; a kill in the last step before the next snapshot
    finds the whole log held and replays only the victim's optimizer steps."""
    ref = h.run_job(tmp_path / "ref", nnodes=2, nproc=2, script=SCRIPT, script_args=AUTO_ARGS,
                    overrides=AUTO_SETTINGS, timeout_s=300)
    h.assert_succeeded(ref)
    k = _capped_interval(ref)
    base = -(-76 // k) * k  # a snapshot after the cap took effect; the kill is k-1 after
    job = h.run_job(tmp_path / "run", nnodes=2, nproc=2, script=SCRIPT, script_args=AUTO_ARGS,
                    overrides=(*AUTO_SETTINGS, f"recovery.fault=1:{base + k}:forward:sigkill"),
                    timeout_s=300)
    h.assert_succeeded(job)
    assert _capped_interval(job) == k
    recs = job.events("recovery")
    assert {(e["target_step"], e["base_step"], e["live"], e["logged"]) for e in recs} == \
        {(base + k - 1, base, True, True)}, recs
    newcomer = [e for e in recs if e["newcomer"]]
    assert newcomer[0]["transfer_parts"]["optimizer_steps_replayed"] == k - 1
    assert all(e["log_bytes"] <= TIGHT_BUDGET - 1018 * 1024 for e in recs)
    h.assert_same_final(ref, job)
