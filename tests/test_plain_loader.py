"""The loader a user already has, handed to ``Checkpointless(loader=...)`` as it is.

The job is ``examples/train_ddp_epochs.py``: the DDP loop of the PyTorch tutorials, with
a ``Dataset`` whose ``__getitem__`` draws a random augmentation, a
``DistributedSampler(shuffle=True)``, a ``DataLoader`` with two workers,
``sampler.set_epoch(epoch)`` and ``for batch in data`` inside ``cl.epochs(2)`` and
``with cl.training_step():``. Each rank records every sample index it trained on; the
final weights, optimizer state and that order must equal a failure-free run's after a
SIGKILL:

- in the second epoch (the survivor's iterator re-opens at the batch after the
  committed step; the replacement's new iterator continues the restored pass);
- in the first step of the second epoch (the epoch boundary, committed before the pass
  opens);
- in the last step (the final commit fails and the loop goes back to the restored
  epoch);

for a plain ``DataLoader``, torchdata's ``StatefulDataLoader`` and ``CachedLoader``. The
in-process tests check the position itself (a stale iterator re-opens at the exact
batch, with and without workers), the refusal of a rollback into an earlier pass, and
that every refusal at registration names the fix.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from recovery.common.errors import RecoveryImpossible
from recovery.loader import loader_position
from replication.training_state.state import StateRegistrationError, TrainingState
from tests.recovery_harness import assert_same_final, assert_succeeded, run_job

SCRIPT = "examples/train_ddp_epochs.py"
STEPS = 32  # 2 epochs x 512 samples / 2 ranks / batch 16


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One failure-free run per loader kind, made on first use."""
    made: dict[str, object] = {}

    def get(kind: str):
        if kind not in made:
            job = run_job(tmp_path_factory.mktemp(f"ref-{kind}"), nproc=2, script=SCRIPT,
                          script_args=("--loader", kind), timeout_s=180)
            assert_succeeded(job)
            assert {f["step"] for f in job.finals().values()} == {STEPS}
            made[kind] = job
        return made[kind]

    return get


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind,fault", [
    ("dataloader", "1:20:backward"),   # mid second epoch
    ("dataloader", "0:17:optimizer"),  # the second epoch's first step
    ("dataloader", "0:32:optimizer"),  # the last step: the final commit fails
    ("stateful", "1:20:backward"),
    ("cached", "0:20:optimizer"),
])
def test_a_kill_replays_the_same_batches(tmp_path, references, kind, fault):
    reference = references(kind)
    job = run_job(tmp_path / "run", nproc=2, spares=1, script=SCRIPT,
                  script_args=("--loader", kind), timeout_s=180,
                  overrides=(f"recovery.fault={fault}:sigkill",))
    assert_succeeded(job)
    assert len(job.events("fault_injected")) == 1 and job.events("recovery"), job.output()
    assert_same_final(reference, job)


# -- in-process: the position itself ---------------------------------------------------
def _loader(workers: int = 0, **kw) -> DataLoader:
    data = TensorDataset(torch.arange(40))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
    return DataLoader(data, batch_size=4, sampler=sampler, num_workers=workers, **kw)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stale_iterator_reopens_at_the_restored_batch(workers):
    data = _loader(workers)
    position = loader_position.track(data)
    assert isinstance(data, DataLoader) and type(data).__name__ == "DataLoader"
    it = iter(data)
    first = [next(it)[0].tolist() for _ in range(3)]
    saved = position.state_dict()
    later = [next(it)[0].tolist() for _ in range(4)]
    position.load_state_dict(saved)  # a rollback to the step after the third batch
    assert [next(it)[0].tolist() for _ in range(4)] == later
    assert len(first) == 3

    fresh = _loader(workers)  # a replacement: a new loader, the restored state, a new iterator
    replacement = loader_position.track(fresh)
    replacement.load_state_dict(saved)
    assert [b[0].tolist() for b in fresh][:4] == later


def test_the_shuffle_of_a_random_sampler_is_reproduced():
    """No sampler given, ``shuffle=True``: the order comes from the global torch
    generator when the iterator is created; a resume creates it from the same state."""
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.arange(40)), batch_size=4, shuffle=True)
    position = loader_position.track(data)
    it = iter(data)
    next(it)
    saved = position.state_dict()
    rest = [b[0].tolist() for b in it]
    torch.manual_seed(99)  # whatever the generator holds at the restore
    position.load_state_dict(saved)
    assert [b[0].tolist() for b in iter(data)] == rest


def test_a_rollback_into_an_earlier_pass_is_refused_with_the_fix():
    data = _loader()
    position = loader_position.track(data)
    for _ in data:
        pass
    end_of_first = position.state_dict()
    it = iter(data)
    next(it)
    position.load_state_dict(end_of_first)
    with pytest.raises(RecoveryImpossible, match=r"cl\.epochs\(N\).*cl\.training_step\(\)"):
        next(it)


def test_refusals_name_the_fix():
    with pytest.raises(StateRegistrationError) as loader:
        loader_position.track(iter(range(3)))
    line = str(loader.value)
    assert "DataLoader" in line and "StatefulDataLoader" in line and "CachedLoader" in line
    assert "\n" not in line
    with pytest.raises(StateRegistrationError) as other:
        TrainingState().register("counter", object())
    assert "give object state_dict() and load_state_dict()" in str(other.value)


def test_a_stateful_object_is_registered_as_it_is():
    class Position:
        def state_dict(self):
            return {}

        def load_state_dict(self, sd):
            pass

    obj = Position()
    assert loader_position.track(obj) is obj


@pytest.mark.timeout(400)
def test_a_new_run_resumes_a_durable_checkpoint_mid_epoch(tmp_path, references):
    """A job that cannot recover in memory (recovery off here) leaves durable checkpoints;
    the same command run again resumes the newest, in the middle of an epoch, and
    goes on at the step after it: the loop's step, the pass's index and the loader's
    position all come from the checkpoint, so the result equals the failure-free run's."""
    durable = (f"persistence.path={tmp_path / 'ckpt'}", "persistence.every_n_steps=3",
               "replication.every_n_steps=3")
    args = ("--loader", "dataloader")
    cut = run_job(tmp_path / "cut", nproc=2, script=SCRIPT, script_args=args, timeout_s=180,
                  overrides=(*durable, "recovery.max_restarts=0",
                             "recovery.fault=1:20:backward:sigkill"))
    assert not cut.timed_out and any(rc for rc in cut.returncodes.values()), cut.output()
    again = run_job(tmp_path / "again", nproc=2, script=SCRIPT, script_args=args,
                    timeout_s=180, overrides=durable)
    assert_succeeded(again)
    resumed = [e["step"] for e in again.events("durable_resume")]
    # the newest complete save before step 20 (a save still being written when the next
    # falls due is skipped, so it may be an earlier one), never at an epoch's end
    assert resumed and 0 < resumed[0] < 20 and resumed[0] % 16, again.output()
    steps = sorted({e["step"] for e in again.events("step")})
    assert steps[0] == resumed[0] + 1 and steps[-1] == STEPS, steps
    assert_same_final(references("dataloader"), again)
