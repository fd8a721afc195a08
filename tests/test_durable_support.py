"""Shared pieces of the durable-tier tests (no tests here).

``faultyfs://`` is a local filesystem registered with fsspec whose writes can be made
slow, failing, "full" (``OSError(ENOSPC)`` past a byte budget) or fatal (the process
SIGKILLs itself halfway through writing a chosen file). Its knobs live on the class
that fsspec has registered (:func:`faulty`), because pytest may import this module
twice under different names and the writer resolves the class through fsspec.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from replication.config import PersistenceConfig
from replication.durable import DurableWriter, SaveResult
from replication.snapshots.snapshot import SnapshotEngine
from replication.training_state.snapshot_meta import SnapshotMeta
from replication.training_state.state import TrainingState
from tests.helpers.training import LoopState, make_model, seed_all, train_step

PROTOCOL = "faultyfs"


class FaultyFS(LocalFileSystem):
    protocol = PROTOCOL
    root_marker = "/"

    budget: int | None = None  # bytes that may still be written (None: unlimited)
    fail_opens = 0  # the next N write-opens raise OSError(EIO)
    fail_always = False  # every write-open raises
    # Only write-opens of paths starting with this prefix count for fail_opens and
    # fail_always (None: every path). The knobs are class-wide, so without it a writer
    # that an earlier test left running (still retrying its own save in the background)
    # would take failures meant for the save under test.
    fail_under: str | None = None
    delay_per_mb_s = 0.0  # sleep per MB written (a slow store)
    # Set: targeted write-opens wait for it first (a store that does not answer until
    # the test lets it), so a test can tell "returned while storage was stuck" without
    # timing anything.
    hold: threading.Event | None = None
    kill_on: str | None = None  # SIGKILL self halfway through writing a path containing this
    write_opens = 0
    lock = threading.Lock()

    @classmethod
    def reset(cls) -> None:
        cls.budget, cls.fail_opens, cls.fail_always, cls.fail_under = None, 0, False, None
        cls.delay_per_mb_s, cls.kill_on, cls.write_opens = 0.0, None, 0
        if cls.hold is not None:
            cls.hold.set()  # a writer still waiting on it must not wait for ever
        cls.hold = None

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        if path.startswith(f"{PROTOCOL}://"):
            path = path[len(PROTOCOL) + 3:]
        return super()._strip_protocol(path)

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        cls = type(self)
        if "w" in mode or "a" in mode:
            hold = cls.hold
            if hold is not None and (cls.fail_under is None or path.startswith(cls.fail_under)):
                hold.wait(60)
            with cls.lock:
                cls.write_opens += 1
                targeted = cls.fail_under is None or path.startswith(cls.fail_under)
                if targeted and (cls.fail_always or cls.fail_opens > 0):
                    cls.fail_opens = max(0, cls.fail_opens - 1)
                    raise OSError(errno.EIO, f"injected I/O error opening {path}")
            return _FaultyFile(super()._open(path, mode, *args, **kwargs), cls, path)
        return super()._open(path, mode, *args, **kwargs)


class _FaultyFile:
    def __init__(self, f: Any, cls: type[FaultyFS], path: str) -> None:
        self._f, self._cls, self._path = f, cls, path
        self._written = 0

    def write(self, data: Any) -> int:
        cls = self._cls
        n = memoryview(data).nbytes
        with cls.lock:
            if cls.budget is not None:
                if n > cls.budget:
                    raise OSError(errno.ENOSPC, "No space left on device (injected)")
                cls.budget -= n
        if cls.kill_on and cls.kill_on in self._path:
            half = memoryview(data).cast("B")[: max(1, n // 2)]
            self._f.write(half)
            self._f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if cls.delay_per_mb_s:
            time.sleep(cls.delay_per_mb_s * n / 1e6)
        self._written += n
        return self._f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _FaultyFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()


def faulty() -> type[FaultyFS]:
    """The registered ``faultyfs`` class (register it on first use)."""
    try:
        return fsspec.get_filesystem_class(PROTOCOL)
    except ValueError:
        fsspec.register_implementation(PROTOCOL, FaultyFS)
        return fsspec.get_filesystem_class(PROTOCOL)


def make_state(seed: int = 0, rank: int = 0, hidden: int = 64) -> tuple[TrainingState, dict]:
    """A model, Adam, a step LR schedule, loop counters and RNG, trained a few steps."""
    seed_all(seed)
    model = make_model(hidden)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    loop = LoopState(rank)
    state = TrainingState()
    for name, obj in (("model", model), ("optim", opt), ("sched", sched), ("loop", loop)):
        state.register(name, obj)
    objs = {"model": model, "optim": opt, "sched": sched, "loop": loop}
    return state, objs


def train(objs: dict, n: int = 1) -> None:
    for _ in range(n):
        train_step(objs["model"], objs["optim"], objs["sched"])
        objs["loop"].step += 1
        objs["loop"].history.append(float(objs["loop"].step))


def snapshot(engine: SnapshotEngine, step: int) -> tuple[SnapshotMeta, torch.Tensor]:
    slot = engine.capture(step)
    meta = engine.seal(slot)
    engine.protect(step)
    assert slot.buffer is not None
    return meta, slot.buffer


def config(path: str, **kw: Any) -> PersistenceConfig:
    kw.setdefault("every_n_steps", 1)
    kw.setdefault("keep_last", 3)
    return PersistenceConfig(path=path, **kw)


def persist(writer: DurableWriter, engine: SnapshotEngine, step: int,
            timeout: float = 60.0) -> SaveResult:
    meta, buf = snapshot(engine, step)
    return writer.submit(meta, buf).result(timeout)


def make_writer(cfg: PersistenceConfig, rank: int = 0, world: int = 1, **kw: Any) -> DurableWriter:
    """A writer that saves from a thread (no helper process to start: faster tests, and
    the ``faultyfs`` knobs set in this process apply). The saving code is the same."""
    kw.setdefault("isolation", "thread")
    return DurableWriter(cfg, rank, world, **kw)


def fast_writer(cfg: PersistenceConfig, rank: int = 0, world: int = 1, **kw: Any) -> DurableWriter:
    kw.setdefault("isolation", "thread")
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("max_backoff_s", 0.05)
    kw.setdefault("retries", 2)
    return DurableWriter(cfg, rank, world, **kw)
