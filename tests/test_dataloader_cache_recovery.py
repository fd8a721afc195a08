"""Real-process tests: a training process is SIGKILLed mid-epoch and replaced.

The replacement starts from the last *committed* loader state (what the recovery runtime
restores from a snapshot), so it rolls back a few steps; those steps must come from the
node cache the dead process left in shared memory, and the concatenated batch sequence
must equal an uninterrupted run's.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from dataloader_cache import CachedLoader, DeterministicSampler

_HERE = Path(__file__).resolve().parent
_REPO = _HERE.parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))
support = importlib.import_module("test_dataloader_cache_support")

N, BS, SEED = 64, 4, 5  # 16 steps per epoch


def spawn_child(tmp_path, name, **overrides):
    args = {
        "repo": str(_REPO),
        "n": N,
        "batch_size": BS,
        "seed": SEED,
        "job_id": "kill-test",
        "cache_dir": str(tmp_path / "node-cache"),
        "prefetch": 2,
        "workers": 1,
        "epochs": 1,
        "commit_every": 3,
        "step_s": 0.0,
        "out": str(tmp_path / f"{name}.jsonl"),
        "log": str(tmp_path / f"{name}.calls"),
        **overrides,
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_REPO), str(_HERE)])}
    proc = subprocess.Popen(
        [sys.executable, str(_HERE / "test_dataloader_cache_support.py"), json.dumps(args)],
        env=env,
        cwd=str(_REPO),
    )
    return proc, args


def wait_for_lines(path, n, proc, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = support.read_lines(path)
        if len(lines) >= n:
            return lines
        if proc.poll() is not None:
            raise AssertionError(f"child exited early with {proc.returncode}")
        time.sleep(0.02)
    raise AssertionError(f"child wrote fewer than {n} lines in {timeout}s")


def reference_batches(epochs=(0,)):
    ref = []
    with CachedLoader(support.RecordingDataset(N), BS, seed=SEED, enabled=False) as loader:
        for e in epochs:
            loader.set_epoch(e)
            ref += [(b["idx"].tolist(), b["x"].tolist()) for b in loader]
    return ref


def test_sigkill_mid_epoch_then_replacement_resumes_from_node_cache(tmp_path):
    ref = reference_batches()
    dead, args = spawn_child(tmp_path, "dead", step_s=0.2)
    wait_for_lines(args["out"], 8, dead)
    dead.send_signal(signal.SIGKILL)
    assert dead.wait(30) == -signal.SIGKILL
    lines = support.read_lines(args["out"])
    assert 8 <= len(lines) < N // BS, "the child must die mid-epoch"
    committed = lines[-1]["committed"]
    c = committed["step"]  # the replacement replays from here (a rollback)
    assert 0 < c < len(lines)

    repl, rargs = spawn_child(tmp_path, "replacement", state=committed)
    assert repl.wait(60) == 0
    rlines = support.read_lines(rargs["out"])
    with open(rargs["out"] + ".done") as f:
        final_stats = json.load(f)

    dead_seq = [(r["idx"], r["x"]) for r in lines]
    repl_seq = [(r["idx"], r["x"]) for r in rlines]
    assert dead_seq[:c] + repl_seq == ref  # nothing lost, nothing repeated, same contents
    assert repl_seq[: len(lines) - c] == dead_seq[c:]  # the replay is identical

    # the replayed steps came from the node cache: hits, and no dataset calls for them
    replayed = len(lines) - c
    assert rlines[replayed - 1]["stats"]["hits"] >= replayed
    assert final_stats["hits"] >= replayed
    sampler = DeterministicSampler(N, BS, seed=SEED)
    replayed_indices = {i for s in range(c, len(lines)) for i in sampler.batch_indices(0, s)}
    calls = support.read_log(rargs["log"])
    assert replayed_indices.isdisjoint(calls)
    assert len(calls) == BS * final_stats["computed"]  # only the misses touched the dataset
    assert final_stats["computed"] < N // BS - c


def test_replacement_on_a_new_node_recomputes_the_same_batches(tmp_path):
    ref = reference_batches(epochs=(0, 1))
    dead, args = spawn_child(tmp_path, "dead", epochs=2, step_s=0.05)
    wait_for_lines(args["out"], 20, dead)  # into epoch 1
    dead.send_signal(signal.SIGKILL)
    dead.wait(30)
    lines = support.read_lines(args["out"])
    committed = lines[-1]["committed"]
    assert committed["epoch"] == 1
    repl, rargs = spawn_child(
        tmp_path, "replacement", epochs=2, state=committed, cache_dir=str(tmp_path / "other")
    )
    assert repl.wait(60) == 0
    rlines = support.read_lines(rargs["out"])
    done = 16 + committed["step"]
    assert [(r["idx"], r["x"]) for r in lines[:done]] + [(r["idx"], r["x"]) for r in rlines] == ref
    assert rlines[-1]["stats"]["hits"] == 0  # empty cache on the new node


@pytest.mark.parametrize("epoch_cache", [False, True])
def test_process_workers_give_the_same_batches(tmp_path, epoch_cache):
    ref = reference_batches(epochs=(0, 1))
    log = tmp_path / "calls.log"
    loader = CachedLoader(
        support.RecordingDataset(N, str(log)),
        BS,
        seed=SEED,
        job_id="proc",
        directory=str(tmp_path / "nc"),
        epoch_cache_path=str(tmp_path / "ec") if epoch_cache else "",
        worker_mode="process",
        workers=1,
        prefetch=3,
    )
    got = []
    for e in (0, 1):
        loader.set_epoch(e)
        got += [(b["idx"].tolist(), b["x"].tolist()) for b in loader]
    s = loader.stats()
    loader.close()
    assert got == ref
    assert s["computed"] == 32 and s["writes"] == 32
    if epoch_cache:
        assert s["epoch_cache_hits"] == N and len(support.read_log(str(log))) == N
    else:
        assert s["samples_loaded"] == 2 * N
    assert isinstance(got[0][1][0][0], float)
    assert torch.tensor(got[0][1]).shape == (BS, 3)


def test_process_workers_exit_when_the_training_process_is_killed(tmp_path):
    out = tmp_path / "pids.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_REPO), str(_HERE)])}
    spec = {"mode": "orphan", "repo": str(_REPO), "out": str(out)}
    parent = subprocess.Popen(
        [sys.executable, str(_HERE / "test_dataloader_cache_support.py"), json.dumps(spec)],
        env=env,
        cwd=str(_REPO),
    )
    try:
        deadline = time.monotonic() + 60
        while not out.exists():
            assert parent.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        pids = json.loads(out.read_text())
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
    deadline = time.monotonic() + 15
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if _running(p)]
        time.sleep(0.05)
    assert alive == [], "preprocessing workers outlived the killed training process"


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
