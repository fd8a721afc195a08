"""The job's world records and a loader standing for several ranks (ADR 0035), in one
process: which record a generation reads, who takes whose data, and the batches a
shrunk rank hands out against the ones the configured world's ranks would have."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler

from recovery.common.errors import RecoveryImpossible
from recovery.generation import world
from recovery.loader import hosted_loader, loader_position


def test_the_launch_world_until_a_record_applies():
    store = dist.HashStore()
    assert world.current(store, 5, 4) == world.World.launch(4)
    first = world.publish(store, world.World(4, (0, 1), after_gen=2))
    assert first.version == 1
    assert world.current(store, 2, 4).slots == (0, 1, 2, 3)  # generation 2 is before it
    assert world.current(store, 3, 4) == first
    second = world.publish(store, world.World(4, (0, 1, 2, 3), after_gen=6))
    assert world.current(store, 6, 4) == first and world.current(store, 7, 4) == second


def test_a_forged_record_is_not_a_world():
    store = dist.HashStore()
    store.add("cl/world/versions", 1)
    store.set("cl/world/1", b'{"configured": 4, "slots": [0], "after_gen": 0}')
    assert world.current(store, 9, 4) == world.World.launch(4)


def test_each_rank_keeps_its_own_data_and_takes_retired_ranks_round_robin():
    w = world.World(8, (0, 1, 2, 3, 6, 7))
    assert w.retired == (4, 5) and w.size == 6 and w.resized
    assert [w.hosted(r) for r in range(6)] == [(0, 4), (1, 5), (2,), (3,), (6,), (7,)]
    assert w.rank_of(6) == 4 and w.rank_of(5) is None
    hosted = sorted(v for r in range(w.size) for v in w.hosted(r))
    assert hosted == list(range(8))


def test_the_environment_of_a_shrunk_world():
    env = {"RANK": "3", "WORLD_SIZE": "4"}
    world.apply_to_environ(world.World(4, (0, 3)), env)
    assert (env["RANK"], env["WORLD_SIZE"], env[world.ENV_SLOT]) == ("1", "2", "3")
    world.apply_to_environ(world.World.launch(4), env)  # grown back: the slot decides
    assert (env["RANK"], env["WORLD_SIZE"]) == ("3", "4")
    with pytest.raises(world.RetiredSlot, match="launch rank 3 is retired"):
        world.apply_to_environ(world.World(4, (0, 1)), env)


class _Indexed(Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.full((2,), float(i)), "pair": (i, torch.tensor(i)), "name": f"s{i}"}


def _rank_batches(world_size: int, rank: int, epoch: int) -> list[dict]:
    sampler = DistributedSampler(_Indexed(), num_replicas=world_size, rank=rank, seed=5)
    sampler.set_epoch(epoch)
    return list(DataLoader(_Indexed(), batch_size=3, sampler=sampler))


@pytest.mark.parametrize("skip", [0, 2])
def test_a_hosting_loader_hands_out_the_configured_ranks_batches_joined(skip):
    """What rank 1 of a world shrunk from 4 to 2 hands out (ranks 1 and 3's data), from a
    sampler the script built for the smaller world, against ranks 1 and 3 of 4."""
    sampler = DistributedSampler(_Indexed(), num_replicas=2, rank=1, seed=5)
    loader = DataLoader(_Indexed(), batch_size=3, sampler=sampler)
    position = loader_position.track(loader)
    position.host((1, 3), 4)
    if skip:
        position.load_state_dict({"passes": 1, "yielded": skip})
    sampler.set_epoch(1)
    got = list(loader)
    ones, threes = _rank_batches(4, 1, 1), _rank_batches(4, 3, 1)
    assert len(got) == len(ones) - skip == 4 - skip
    for batch, a, b in zip(got, ones[skip:], threes[skip:], strict=True):
        assert torch.equal(batch["x"], torch.cat([a["x"], b["x"]]))
        assert batch["pair"][0].tolist() == a["pair"][0].tolist() + b["pair"][0].tolist()
        assert batch["name"] == a["name"] + b["name"]
    assert position.at_pass_end()


def test_a_loader_that_cannot_split_by_rank_is_refused_in_one_line():
    plain = DataLoader(_Indexed(), batch_size=2, sampler=RandomSampler(_Indexed()))
    with pytest.raises(RecoveryImpossible, match=r"RandomSampler.*does not split the data"):
        loader_position.track(plain).host((0, 2), 4)
    assert hosted_loader.refusal(object()) is not None


def test_no_store_no_resize(monkeypatch):
    """A standalone process has no job store: its environment is left alone."""
    from recovery.resize import world_resize

    env = {"RANK": "0", "WORLD_SIZE": "1"}
    world_resize.enter_current_world(env)
    assert env == {"RANK": "0", "WORLD_SIZE": "1"}
    assert os.environ.get(world.ENV_SLOT) is None


def test_who_offers_its_state_to_whom():
    """Growing 2 -> 4: each retired rank is offered by the rank that took its data; a
    rank whose process died with its node (slot 1 of 4 -> 2) by every survivor."""
    from recovery.resize.world_resize import _twins

    shrunk, full = world.World(4, (0, 1)), world.World.launch(4)
    # each also offers to the other survivor, in case its process dies meanwhile
    assert _twins(shrunk, full, 0) == (1, 2) and _twins(shrunk, full, 1) == (0, 3)
    assert _twins(full, shrunk, 0) == (1,) and _twins(full, shrunk, 1) == (0,)
