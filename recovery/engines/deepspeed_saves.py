"""``engine.save_checkpoint`` under the runtime: asynchronous, atomic, checksummed (ADR 0052).

``Checkpointless(engine=...)`` puts :class:`DurableCheckpointEngine` in the engine's
``checkpoint_engine`` (DeepSpeed's own plug-in point for how its files are written) and
wraps ``engine.save_checkpoint`` so that DeepSpeed itself never writes ``latest``. The
script's call is unchanged and DeepSpeed's layout is kept, so plain
``engine.load_checkpoint(save_dir)`` without the runtime loads what it wrote:

- the training loop waits only while DeepSpeed's state dicts are serialized into host
  memory (``torch.save`` into a buffer, the bytes DeepSpeed would have written); a
  background thread writes them;
- the files go to a staging directory, and the tag directory appears, with a manifest of
  every file's size and xxh3-128, only once every rank has written its part; ``latest``
  names it after that (:mod:`replication.durable.tagged`). A save cut short by a failure
  is never what ``latest`` names, and the replay after the recovery saves it again;
- a save starts only once this rank's previous one is written: back-pressure, never a
  skipped save. What each save cost goes to the event log (``tagged_checkpoint``);
- loads through the engine check each file against the manifest before unpickling it.

The process waits for its saves to be written before it exits. A save that cannot be
written (a full disk) is logged with one line and the tag is not committed; training
goes on, and the previous ``latest`` stays.
"""

from __future__ import annotations

import atexit
import io
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)

from replication.durable.format import Manifest
from replication.durable.tagged import TaggedSave, local_dir, read_verified

log = logging.getLogger("checkpointless.deepspeed")

LAYOUT = "deepspeed"
#: How long rank 0 waits for the other ranks' parts of one save before giving it up.
COMMIT_TIMEOUT_S = 600.0
#: A wait for the previous save longer than this is said on the console.
SLOW_WAIT_S = 5.0
Emit = Callable[..., None]


def install(engine: Any, *, generation: Callable[[], int], run_id: str, emit: Emit,
            before_commit: Callable[[int], None] | None = None) -> DurableCheckpointEngine:
    """Route ``engine``'s checkpoints through the runtime (see the module docstring).
    ``generation``: the runtime's, read when each save starts and while rank 0 waits;
    ``before_commit(step)``: called once a rank's files are written (fault injection)."""
    saves = DurableCheckpointEngine(engine, generation, run_id, emit, before_commit)
    original = engine.save_checkpoint

    def save_checkpoint(save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006
                        exclude_frozen_parameters=False):
        """DeepSpeed's, with ``latest`` written by the runtime once the tag is complete."""
        if engine.checkpoint_engine is not saves:  # the script put another one in place
            return original(save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        saves.begin(save_dir, tag, bool(save_latest))
        return original(save_dir, tag, client_state, False, exclude_frozen_parameters)

    engine.checkpoint_engine = saves
    engine.save_checkpoint = save_checkpoint
    return saves


class DurableCheckpointEngine(CheckpointEngine):
    """DeepSpeed's ``CheckpointEngine`` whose saves the runtime writes in the background."""

    def __init__(self, engine: Any, generation: Callable[[], int], run_id: str, emit: Emit,
                 before_commit: Callable[[int], None] | None = None) -> None:
        super().__init__(None)
        self.name = "CheckpointlessCheckpointEngine"
        previous = getattr(engine, "checkpoint_engine", None)
        self._zipfile = bool(getattr(previous, "zipfile_serialization", True))
        self._engine, self._generation, self._run_id = engine, generation, run_id
        self._emit, self._before_commit = emit, before_commit
        self._save: TaggedSave | None = None  # the save DeepSpeed is in, on this thread
        self._latest = True
        self._gen, self._count = -1, 0  # saves started in this generation
        self._stats: dict[str, dict[str, float]] = {}
        self._idle = threading.Event()
        self._idle.set()
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._write_loop, name="checkpointless-deepspeed-save",
                         daemon=True).start()
        atexit.register(self.flush)

    # -- the training thread: what DeepSpeed's save_checkpoint calls ------------------
    def begin(self, save_dir: str, tag: Any, latest: bool) -> None:
        """A save starts: once the previous one is written, on every rank alike."""
        path = local_dir(save_dir)
        t0 = time.perf_counter()
        self._wait_idle("the previous DeepSpeed checkpoint to be written")
        gen = self._generation()
        self._gen, self._count = gen, (self._count + 1 if gen == self._gen else 1)
        e = self._engine
        name = str(tag) if tag is not None else f"global_step{e.global_steps}"
        self._save = TaggedSave(path, name, f"{gen}-{self._count}", dist.get_rank(),
                                dist.get_world_size(), int(e.global_steps), self._run_id, LAYOUT)
        self._latest = latest
        self._stats[self._save.attempt] = {"waited_s": time.perf_counter() - t0,
                                           "serialize_s": 0.0, "write_s": 0.0}
        self._idle.clear()

    def create(self, info: CheckpointCommitInfo) -> None:
        if self._save is None:  # DeepSpeed's save_checkpoint reached without the wrapper
            self.begin(info.save_dir, info.tag, False)  # and DeepSpeed writes latest itself

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        if self._save is not None and (path == self._save.final or self._save.staged(path)):
            return  # the tag's directory: its staging one is made when written
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: dict[str, Any], path: str) -> None:
        rel = self._save.staged(path) if self._save is not None else None
        if rel is None:  # not under the tag DeepSpeed is saving: as DeepSpeed would
            torch.save(state_dict, path, _use_new_zipfile_serialization=self._zipfile)
            return
        t0 = time.perf_counter()
        buf = io.BytesIO()
        torch.save(state_dict, buf, _use_new_zipfile_serialization=self._zipfile)
        self._stats[self._save.attempt]["serialize_s"] += time.perf_counter() - t0
        self._queue.put(("file", self._save, rel, buf.getbuffer()))

    def commit(self, info: CheckpointCommitInfo) -> bool:
        save, self._save = self._save, None
        if save is None:
            return True
        if self._before_commit is not None:  # a fault due here finds the files written
            self._queue.join()
            self._before_commit(save.step)
        self._queue.put(("commit", save, self._latest, self._gen))
        return True

    def load(self, path: str, map_location: Any = None) -> Any:
        """DeepSpeed's ``torch.load``, after checking the file against the manifest."""
        return torch.load(io.BytesIO(read_verified(path)), map_location=map_location,
                          weights_only=False)  # DeepSpeed's files hold its own objects

    def flush(self, progress_s: float = 10.0) -> None:
        """Wait until every save handed over is written (and, on rank 0, committed)."""
        self._wait_idle("DeepSpeed checkpoints to be written before exiting", progress_s)

    # -- the writer thread ------------------------------------------------------------
    def _write_loop(self) -> None:
        failed: dict[str, str] = {}  # attempt -> why its files could not all be written
        while True:
            kind, save, *rest = self._queue.get()
            try:
                if save.attempt in failed:
                    if kind == "commit":
                        why = failed.pop(save.attempt)
                        save.give_up(why)
                        self._report(save, None, why)
                    continue
                if kind == "file":
                    t0 = time.perf_counter()
                    save.write(*rest)
                    self._stats[save.attempt]["write_s"] += time.perf_counter() - t0
                else:
                    self._finish(save, *rest)
            except Exception as exc:  # a full disk, a permission: one line, training goes on
                why = f"{type(exc).__name__}: {exc}"[:300]
                if kind == "commit":
                    self._report(save, None, why)
                else:
                    failed[save.attempt] = why
            finally:
                if kind == "commit":
                    self._idle.set()
                self._queue.task_done()

    def _finish(self, save: TaggedSave, latest: bool, gen: int) -> None:
        t0 = time.perf_counter()
        save.finish_rank()
        manifest = None
        if save.rank == 0:
            def abandoned() -> str | None:
                if self._generation() != gen:
                    return "a failure interrupted it (the replay saves it again)"
                return None

            manifest = save.commit(point_latest=latest, abandoned=abandoned,
                                   timeout_s=COMMIT_TIMEOUT_S)
        self._stats[save.attempt]["write_s"] += time.perf_counter() - t0
        self._report(save, manifest, None)

    def _report(self, save: TaggedSave, manifest: Manifest | None, error: str | None) -> None:
        """One ``tagged_checkpoint`` event per rank and save: ``written`` (its part),
        ``committed`` (rank 0: the tag is in place), what the loop waited for, and why
        not (``error``: this rank's part; ``reason``: the commit's)."""
        stats = self._stats.pop(save.attempt, {})
        if error is not None:
            log.error("checkpointless: DeepSpeed checkpoint %s (step %d) was not written: %s",
                      save.final, save.step, error)
        self._emit(tag=save.tag, step=save.step, rank=save.rank, path=save.final,
                   attempt=save.attempt, written=error is None,
                   bytes=sum(f.size for f in save.files.values()),
                   **({"committed": manifest is not None} if save.rank == 0 else {}),
                   **{k: round(v, 4) for k, v in stats.items()},
                   **({"error": error} if error else {}),
                   **({"reason": save.not_committed} if save.not_committed else {}))

    def _wait_idle(self, what: str, progress_s: float = SLOW_WAIT_S) -> None:
        t0 = time.monotonic()
        while not self._idle.wait(progress_s):
            log.warning("checkpointless: waiting for %s (%.0fs so far)", what,
                        time.monotonic() - t0)
