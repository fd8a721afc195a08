"""Optional preprocessing worker processes (``worker_mode="process"``).

Why this exists next to threads: preprocessing written in pure Python holds the GIL, so
prefetch threads cannot run it in parallel with the training loop (or each other).
numpy/torch kernels release the GIL, which is why threads are the default: no pickling of
the dataset, no start-up cost, no copy between processes. When the profile says the GIL
is the bottleneck, processes are the fix.

Why not ``multiprocessing.Pool`` / ``ProcessPoolExecutor``: their workers share a queue
whose write end every child also holds, so when the training process is SIGKILLed (the
failure this package exists for) the children never see EOF and linger. Here each
worker has a private pipe whose other end only the parent holds: the parent's death is an
EOF, and workers also poll ``getppid()`` as a second line of defence.

Workers send back the *encoded* batch (the same checksummed frame the node cache
stores), so the parent writes it to the cache without re-encoding; counters are
shipped back with each reply.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from replication.errors import CheckpointlessError

from .codec import encode
from .epoch_cache import EpochSampleCache
from .sampler import DeterministicSampler
from .sources import MapSource
from .stats import Counters


class WorkerError(CheckpointlessError, RuntimeError):
    """A preprocessing worker process raised or died."""


def _worker_main(
    conn: Any,
    dataset: Any,
    samplers: Sequence[DeterministicSampler],
    collate_fn: Callable[[list[Any]], Any],
    epoch_cache: tuple[str, str, int] | None,
    parent_pid: int,
) -> None:
    import torch

    torch.set_num_threads(1)  # one core per worker: the pool size is the parallelism
    counters = Counters()
    ec = None
    if epoch_cache is not None:
        path, fp, budget = epoch_cache
        ec = EpochSampleCache(path, fp, budget, counters=counters)
    sources = [MapSource(dataset, s, collate_fn, ec, counters) for s in samplers]
    while True:
        if not conn.poll(1.0):
            if os.getppid() != parent_pid:
                return  # orphaned: the training process died
            continue
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        epoch, step, part = msg
        counters.reset()
        try:
            frame = encode(sources[part].compute(epoch, step))
        except BaseException as e:
            conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}", None))
            continue
        conn.send(("ok", frame.nbytes, counters.snapshot()))
        conn.send_bytes(frame.tobytes())


class _Worker:
    def __init__(self, proc: Any, conn: Any) -> None:
        self.proc = proc
        self.conn = conn


class ProcessPool:
    """A fixed pool of spawned processes computing map-style batches on request.

    ``compute`` is called from the loader's prefetch threads; each call borrows one idle
    worker for the duration of one batch.
    """

    def __init__(
        self,
        n: int,
        dataset: Any,
        samplers: DeterministicSampler | Sequence[DeterministicSampler],
        collate_fn: Callable[[list[Any]], Any],
        epoch_cache: tuple[str, str, int] | None,
    ) -> None:
        """``samplers``: one per rank whose batches the pool computes (``part`` of
        :meth:`compute` picks one), or a single sampler."""
        if isinstance(samplers, DeterministicSampler):
            samplers = [samplers]
        ctx = mp.get_context("spawn")
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: list[_Worker] = []
        self._closed = threading.Event()
        for _ in range(n):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main,
                args=(child, dataset, list(samplers), collate_fn, epoch_cache, os.getpid()),
                daemon=True,
                name="checkpointless-preprocess",
            )
            proc.start()
            child.close()  # only the worker holds its end: our death is its EOF
            w = _Worker(proc, parent)
            self._all.append(w)
            self._idle.put(w)

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers (for supervisors and tests)."""
        return [w.proc.pid for w in self._all if w.proc.pid is not None]

    def compute(
        self, epoch: int, step: int, part: int = 0
    ) -> tuple[bytearray, dict[str, int]]:
        """Encoded batch (of sampler ``part``) and the worker's counters for it."""
        if self._closed.is_set():
            raise WorkerError("process pool is closed")
        w = self._idle.get()
        try:
            w.conn.send((epoch, step, part))
            kind, info, stats = w.conn.recv()
            if kind == "err":
                raise WorkerError(
                    f"preprocessing worker failed on epoch {epoch} step {step}: {info}"
                )
            buf = bytearray(info)
            w.conn.recv_bytes_into(buf)
            return buf, stats
        except (EOFError, OSError) as e:
            raise WorkerError(
                f"preprocessing worker pid {w.proc.pid} died (exit code {w.proc.exitcode})"
            ) from e
        finally:
            self._idle.put(w)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the workers (politely, then by force)."""
        if self._closed.is_set():
            return
        self._closed.set()
        for w in self._all:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        for w in self._all:
            w.proc.join(timeout)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(1.0)
            w.conn.close()
