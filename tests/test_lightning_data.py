"""The resumable training-loader wrapper of the Lightning strategy (no Trainer needed).

A plain ``DataLoader`` over a ``DistributedSampler`` (what Lightning builds for a
shuffled loader under DDP) must resume at the right batch with the same shuffle, and
a restored state must replay the torch RNG the epoch's iterator was created from.
"""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from recovery.integrations.lightning.data import ResumableLoader


class Hooks:
    """What the strategy provides: counts the step-boundary calls."""

    def __init__(self) -> None:
        self.fetches: list[bool] = []
        self.created = 0
        self.epoch = 0

    def before_fetch(self, first: bool) -> None:
        self.fetches.append(first)

    def after_iterator_created(self) -> None:
        self.created += 1

    def current_epoch(self) -> int:
        return self.epoch


def make_loader(workers: int = 0) -> DataLoader:
    data = TensorDataset(torch.arange(40).float().unsqueeze(1))
    sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)
    sampler.set_epoch(2)
    return DataLoader(data, batch_size=3, sampler=sampler, num_workers=workers)


def values(batches: list) -> list[list[float]]:
    return [b[0].flatten().tolist() for b in batches]


@pytest.mark.parametrize("workers", [0, 2])
def test_resumes_at_the_right_batch_with_the_same_shuffle(workers):
    torch.manual_seed(0)
    hooks = Hooks()
    loader = ResumableLoader(make_loader(workers), hooks)
    assert len(loader) == 7 and loader.sampler.epoch == 2  # attributes pass through
    it = iter(loader)
    first = [next(it) for _ in range(3)]
    state = loader.state_dict()
    rest = list(it)
    assert state["yielded"] == 3 and hooks.fetches[:4] == [True, False, False, False]

    torch.manual_seed(1234)  # the resumed process's RNG is elsewhere: must not matter
    again = ResumableLoader(make_loader(workers), Hooks())
    again.load_state_dict(state)
    resumed = list(again)
    assert values(resumed) == values(rest)
    assert values(first + resumed) == values(list(ResumableLoader(make_loader(workers),
                                                                  Hooks())))


def test_iterator_creation_replays_the_recorded_rng():
    """A RandomSampler draws its shuffle from the global generator at ``iter()``."""
    data = TensorDataset(torch.arange(20).float())
    torch.manual_seed(7)
    loader = ResumableLoader(DataLoader(data, batch_size=2, shuffle=True), Hooks())
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    expected = values(list(it))
    torch.manual_seed(99)
    again = ResumableLoader(DataLoader(data, batch_size=2, shuffle=True), Hooks())
    again.load_state_dict(state)
    before = torch.get_rng_state()
    assert values(list(again)) == expected
    assert torch.equal(before, torch.get_rng_state()), "the replay must not move the RNG"


def test_iterators_are_created_lazily_after_set_epoch():
    hooks = Hooks()
    base = make_loader()
    loader = ResumableLoader(base, hooks)
    it = iter(loader)
    base.sampler.set_epoch(5)  # Lightning sets the epoch after iter(), before next()
    got = values(list(it))
    base.sampler.set_epoch(5)
    assert got == values(list(base)) and hooks.created == 1


def test_stateful_inner_loader_restores_itself():
    class Counter:
        def __init__(self) -> None:
            self.pos = 0

        def __len__(self) -> int:
            return 5

        def __iter__(self):
            while self.pos < 5:
                self.pos += 1
                yield self.pos

        def state_dict(self) -> dict:
            return {"pos": self.pos}

        def load_state_dict(self, sd: dict) -> None:
            self.pos = sd["pos"]

    loader = ResumableLoader(Counter(), Hooks())
    it = iter(loader)
    assert [next(it), next(it)] == [1, 2]
    state = loader.state_dict()
    assert state["inner"] == {"pos": 2}
    again = ResumableLoader(Counter(), Hooks())
    again.load_state_dict(state)
    assert list(again) == [3, 4, 5]


def test_bad_state_is_refused_with_the_key():
    loader = ResumableLoader(make_loader(), Hooks())
    with pytest.raises(ValueError, match="'yielded'"):
        loader.load_state_dict({"yielded": -1})
    with pytest.raises(ValueError, match="stateful loader"):
        loader.load_state_dict({"yielded": 1, "inner": {}})
