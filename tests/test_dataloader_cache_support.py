"""Datasets and a child-process driver shared by the dataloader_cache tests.

Importable by spawned worker processes (the datasets must be picklable by reference),
and runnable as a script: ``python test_dataloader_cache_support.py '<json args>'`` is
the training process the recovery tests SIGKILL and replace. It writes one JSON line per
batch (flushed, so the lines survive a SIGKILL) with the batch contents and the loader
state after it, and records every ``__getitem__`` call in a log file of its own.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset


def sample_of(i: int) -> dict[str, Any]:
    """The deterministic content of sample ``i``."""
    return {"x": torch.tensor([i, i + 0.5, (i * 7) % 13], dtype=torch.float32), "idx": i}


class RecordingDataset(Dataset):
    """Map-style dataset that appends every ``__getitem__`` index to a log file.

    The log path is a private attribute so it does not enter the cache fingerprint:
    the killed process and its replacement log to different files but share the cache.
    """

    def __init__(self, n: int, log_path: str | None = None, delay_s: float = 0.0) -> None:
        self.n = n
        self._log = log_path
        self._delay = delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        if self._log:
            with open(self._log, "a") as f:
                f.write(f"{i}\n")
        if self._delay:
            time.sleep(self._delay)
        return sample_of(i)


class FailingDataset(RecordingDataset):
    """Raises on one index (tests that worker errors reach the caller)."""

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i == 3:
            raise RuntimeError("bad sample 3")
        return super().__getitem__(i)


class Stream(IterableDataset):
    """An iterable dataset whose content depends on the epoch set on it."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = 0
        self._consumed = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        for i in range(self.n):
            self._consumed += 1
            yield {"idx": i + 1000 * self.epoch, "x": torch.full((2,), float(i))}


def read_log(path: str) -> list[int]:
    """Indices recorded by a :class:`RecordingDataset`."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [int(line) for line in f if line.strip()]


def read_lines(path: str) -> list[dict[str, Any]]:
    """The complete JSON lines a child wrote (a torn last line is ignored)."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return out


def child_main(args: dict[str, Any]) -> None:
    """Iterate a loader as a training process would; see the module docstring."""
    sys.path.insert(0, args["repo"])
    from dataloader_cache import CachedLoader

    ds = RecordingDataset(args["n"], args["log"])
    loader = CachedLoader(
        ds,
        batch_size=args["batch_size"],
        seed=args["seed"],
        job_id=args["job_id"],
        directory=args["cache_dir"],
        prefetch=args["prefetch"],
        workers=args["workers"],
        lookback=args.get("lookback", 8),
    )
    if args.get("state"):
        loader.load_state_dict(args["state"])
    committed = None
    with open(args["out"], "a") as out:
        for epoch in range(loader.epoch, args["epochs"]):
            loader.set_epoch(epoch)
            for batch in loader:
                state = loader.state_dict()
                if args["commit_every"] and state["step"] % args["commit_every"] == 0:
                    loader.mark_committed()
                    committed = state
                rec = {
                    "epoch": state["epoch"],
                    "step": state["step"] - 1,
                    "idx": batch["idx"].tolist(),
                    "x": batch["x"].tolist(),
                    "state": state,
                    "committed": committed,
                    "stats": loader.stats(),
                }
                out.write(json.dumps(rec) + "\n")
                out.flush()
                time.sleep(args["step_s"])
    loader.close()
    with open(args["out"] + ".done", "w") as f:
        json.dump(loader.stats(), f)


def orphan_main(args: dict[str, Any]) -> None:
    """Start process workers, report their pids, then wait to be SIGKILLed."""
    sys.path.insert(0, args["repo"])
    from dataloader_cache import CachedLoader

    loader = CachedLoader(
        RecordingDataset(16),
        batch_size=4,
        enabled=False,
        worker_mode="process",
        workers=2,
    )
    next(iter(loader))  # the workers are up and serving
    with open(args["out"] + ".tmp", "w") as f:
        json.dump(loader.worker_pids, f)
    os.replace(args["out"] + ".tmp", args["out"])
    time.sleep(600)


if __name__ == "__main__":
    _args = json.loads(sys.argv[1])
    if _args.get("mode") == "orphan":
        orphan_main(_args)
    else:
        child_main(_args)
