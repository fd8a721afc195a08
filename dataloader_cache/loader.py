"""``CachedLoader``: a deterministic, resumable, prefetching loader over a node cache.

Position model. The loader has one position ``(epoch, step)``: the batch it will hand
out next. It moves only when a batch is handed to the caller, never when a batch is
prefetched, and :meth:`CachedLoader.state_dict` reports exactly it. That is what makes
resumption exact: Lightning (and any loop) snapshots the loader state after consuming a
batch, and a loader that reported its prefetch position would silently skip the
prefetched batches on resume. Loading a state, :meth:`seek` and :meth:`set_epoch` all
just move the position; prefetched work outside the new window is dropped (what already
ran stays in the node cache, where a later request may find it).

Pipeline. For each of the next ``prefetch`` steps from the position, a background worker runs
``produce(epoch, step)``: look the batch up in the node cache; on a miss (or a corrupt
entry), build it from the dataset (through the epoch cache for map-style datasets),
write it to the node cache, and return it. Every batch therefore lands in the node
cache before it reaches the model, so a replacement process finds every batch its
predecessor consumed since the last commit and can replay them without the dataset.

Cold start (new process, or a seek): only the head step is scheduled before waiting, so
the caller never waits for more than its own next batch; the rest of the window is
scheduled as soon as that batch is handed out and fills in the background.

Workers. Threads by default: the cache path is I/O plus memcpy, and numpy/torch
preprocessing releases the GIL. Pure-Python preprocessing holds the GIL; use
``worker_mode="process"`` for it (map-style datasets only; see ``workers.py``).

Epoch boundaries. Iterating a loader whose epoch is finished starts the next epoch
(``epoch + 1``, step 0), the same as torchdata's ``StatefulDataLoader``; ``set_epoch(e)``
with a different epoch moves to ``(e, 0)`` and with the current epoch keeps the position,
so a loop that calls ``set_epoch`` with the epoch it resumed in continues mid-epoch.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from torch.utils.data import DataLoader, default_collate

from replication import contract

from .arguments import Arguments, build_config, is_iterable_dataset
from .codec import CorruptEntryError, Frame, decode, encode
from .config import DataloaderCacheConfig
from .epoch_cache import EpochSampleCache
from .fingerprint import callable_name, combine, dataset_fingerprint
from .node_cache import CORRUPT, HIT, BatchKey, NodeBatchCache
from .sampler import DeterministicSampler
from .sources import END, IterableSource, MapSource
from .stats import Counters
from .workers import ProcessPool

log = logging.getLogger(__name__)

STATE_VERSION = 1


def default_job_id() -> str:
    """The job id from the environment (:func:`replication.contract.job_id`: the
    launcher's, else torchrun's), or ``"local"`` for a script run on its own."""
    value = contract.job_id()
    return value if value and value != "none" else "local"


class _Iterator:
    """What ``iter(loader)`` returns; reads the loader's live position on every ``next``,
    so a ``seek`` during a ``for`` loop (a recovery rollback) takes effect immediately."""

    def __init__(self, loader: CachedLoader) -> None:
        self._loader = loader

    def __iter__(self) -> _Iterator:
        return self

    def __next__(self) -> Any:
        return self._loader._next_batch()


class CachedLoader:
    """Deterministic, resumable, prefetching data loading over node and epoch caches.

    Args:
        data: a map-style or iterable ``Dataset``, or a ``torch.utils.data.DataLoader``
            (its dataset, batch_size, collate_fn, drop_last and shuffling are taken, and a
            ``DistributedSampler``'s seed, rank and replica count). The DataLoader's own
            workers are not used: this loader prefetches itself.
        batch_size: samples per batch per data-parallel rank.
        seed: the shuffle order of epoch ``e`` is ``randperm`` seeded with ``seed + e``
            (default 0), exactly ``DistributedSampler``'s order.
        dp_rank, dp_world: data-parallel coordinates (default: torch.distributed, or 0/1).
        job_id: names the node cache directory (default: the job's id, see
            :func:`default_job_id`); a replacement must use the same one to find it.
        config: a :class:`DataloaderCacheConfig`; its fields may also be given as keyword
            arguments (``prefetch=4``), which override it.
        shuffle, drop_last, collate_fn: as for ``DataLoader`` (shuffle defaults to True
            for map-style datasets).
        fingerprint: replaces the heuristic dataset fingerprint used in cache keys.
        worker_mode: ``"thread"`` (default) or ``"process"`` (see the module docstring).
    """

    def __init__(
        self,
        data: Any,
        batch_size: int | None = None,
        *,
        seed: int | None = None,
        dp_rank: int | None = None,
        dp_world: int | None = None,
        job_id: str | None = None,
        config: DataloaderCacheConfig | None = None,
        shuffle: bool | None = None,
        drop_last: bool | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        fingerprint: str | None = None,
        worker_mode: str = "thread",
        **config_overrides: Any,
    ) -> None:
        self.config = build_config(config, config_overrides)
        args = Arguments(data, batch_size, seed, dp_rank, dp_world, shuffle, drop_last, collate_fn)
        if isinstance(data, DataLoader):
            args.take_from_dataloader(data)
        args.validate(worker_mode)
        self._set_identity(args, job_id)
        self._fingerprint_given, self._worker_mode_given = fingerprint, worker_mode
        self._set_fingerprint(fingerprint)
        self._open_caches()
        n_threads = self._build_source(worker_mode)
        self._start_workers(worker_mode, n_threads)
        self._epoch = 0
        self._step = 0
        self._done = False  # iterable datasets: the stream of this epoch has ended
        self._inflight: dict[tuple[int, int], Future[Any]] = {}
        self._closed = False

    # The steps of __init__, in order. Their warnings use stacklevel=3: one frame up
    # from __init__, at the code that built the loader.
    def _set_identity(self, args: Arguments, job_id: str | None) -> None:
        """The loader's settings, from the resolved arguments."""
        self.dataset = args.dataset
        self.batch_size = int(args.batch_size)
        self.seed = 0 if args.seed is None else int(args.seed)
        self.dp_rank = int(args.dp_rank)
        self.dp_world = int(args.dp_world)
        self.iterable = is_iterable_dataset(args.dataset)
        self.shuffle = (not self.iterable) if args.shuffle is None else bool(args.shuffle)
        self.drop_last = bool(args.drop_last)
        self.collate_fn = args.collate_fn or default_collate
        self.job_id = job_id or default_job_id()
        self.counters = Counters()
        #: the data-parallel ranks whose batches each step joins (see :meth:`host`)
        self.ranks: tuple[int, ...] = (self.dp_rank,)
        self._join: Callable[[list[Any]], Any] | None = None

    def _set_fingerprint(self, fingerprint: str | None) -> None:
        """The cache key's fingerprint: the dataset's, and everything that shapes a batch."""
        self.dataset_fingerprint = fingerprint or dataset_fingerprint(self.dataset)
        self.fingerprint = combine(
            self.dataset_fingerprint,
            self.batch_size,
            self.seed,
            self.dp_world,
            self.shuffle,
            self.drop_last,
            self.iterable,
            callable_name(self.collate_fn),
        )

    def _open_caches(self) -> None:
        """The node cache (when enabled) and the epoch cache (when configured)."""
        cfg = self.config
        self.node_cache: NodeBatchCache | None = None
        if cfg.enabled:
            self.node_cache = NodeBatchCache(
                self.job_id,
                cfg.directory,
                cfg.size_budget_bytes,
                cfg.lookback,
                counters=self.counters,
            )
        self.epoch_cache: EpochSampleCache | None = None
        if cfg.epoch_cache_path and self.iterable:
            warnings.warn(
                "dataloader_cache: the epoch cache needs sample indices and is not used for "
                "iterable datasets (the node cache still is)",
                stacklevel=3,
            )
        elif cfg.epoch_cache_path:
            self.epoch_cache = EpochSampleCache(
                cfg.epoch_cache_path,
                self.dataset_fingerprint,
                cfg.epoch_cache_budget_bytes,
                counters=self.counters,
            )

    def _build_source(self, worker_mode: str) -> int:
        """The batch source (and, for a map-style dataset, its sampler and worker
        processes); returns how many prefetch threads it takes."""
        cfg = self.config
        self._pool: ProcessPool | None = None
        self._source: MapSource | IterableSource
        self._parts: list[Any]
        if self.iterable:
            self._source = IterableSource(
                self.dataset,
                self.batch_size,
                self.collate_fn,
                self.counters,
                dp_rank=self.dp_rank,
                dp_world=self.dp_world,
                drop_last=self.drop_last,
            )
            if worker_mode == "process":
                warnings.warn(
                    "dataloader_cache: worker_mode='process' needs a map-style dataset; "
                    "the iterable dataset is read by one prefetch thread",
                    stacklevel=3,
                )
            self._parts = [self._source]
            return min(1, cfg.workers)  # a stream is consumed by one worker
        samplers = [
            DeterministicSampler(
                len(self.dataset),
                self.batch_size,
                seed=self.seed,
                dp_rank=rank,
                dp_world=self.dp_world,
                shuffle=self.shuffle,
                drop_last=self.drop_last,
            )
            for rank in self.ranks
        ]
        self.sampler = samplers[0]
        self._parts = [
            MapSource(self.dataset, sampler, self.collate_fn, self.epoch_cache, self.counters)
            for sampler in samplers
        ]
        self._source = self._parts[0]
        if worker_mode == "process" and cfg.workers > 0:
            ec = None
            if self.epoch_cache is not None:
                ec = (
                    cfg.epoch_cache_path,
                    self.dataset_fingerprint,
                    cfg.epoch_cache_budget_bytes,
                )
            self._pool = ProcessPool(cfg.workers, self.dataset, samplers, self.collate_fn, ec)
        return cfg.workers

    def _start_workers(self, worker_mode: str, n_threads: int) -> None:
        """The prefetch threads, and the finalizer that stops them and the processes."""
        self.worker_mode = worker_mode if self._pool is not None else "thread"
        self._executor = (
            ThreadPoolExecutor(n_threads, thread_name_prefix="checkpointless-prefetch")
            if n_threads > 0
            else None
        )
        self._finalizer = weakref.finalize(self, _shutdown, self._executor, self._pool)

    # ------------------------------------------------------------------ position
    @property
    def epoch(self) -> int:
        """Epoch of the next batch."""
        return self._epoch

    @property
    def step(self) -> int:
        """Batches handed out so far in the current epoch (= step of the next batch)."""
        return self._step

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the preprocessing worker processes (empty in thread mode)."""
        return self._pool.pids if self._pool is not None else []

    def __len__(self) -> int:
        n = self._source.num_batches()
        if n is None:
            raise TypeError("the length of a CachedLoader over an iterable dataset is unknown")
        return n

    def _epoch_finished(self) -> bool:
        n = self._source.num_batches()
        return self._done if n is None else self._step >= n

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of ``epoch`` unless it is already the current epoch."""
        if epoch != self._epoch:
            self.seek(epoch, 0)

    def seek(self, epoch: int, step: int) -> None:
        """Make ``(epoch, step)`` the next batch handed out (recovery rolls back with this)."""
        if epoch < 0 or step < 0:
            raise ValueError(f"cannot seek to a negative position ({epoch}, {step})")
        n = self._source.num_batches()
        if n is not None and step > n:
            raise ValueError(f"step {step} is past the end of an epoch of {n} batches")
        if (epoch, step) == (self._epoch, self._step) and not self._done:
            return
        self._epoch, self._step, self._done = int(epoch), int(step), False
        self._drop_outside_window()

    def mark_committed(self, epoch: int | None = None, step: int | None = None) -> None:
        """Tell the node cache which position is committed (default: the current one).

        Batches from ``step - lookback`` on stay cached so a rollback to the committed
        step replays from the cache; older ones are deleted.
        """
        if self.node_cache is None:
            return
        epoch = self._epoch if epoch is None else epoch
        step = self._step if step is None else step
        for rank in self.ranks:
            self.node_cache.mark_committed(self.fingerprint, rank, epoch, step)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Position of the last handed-out batch, as plain ints/strings (torchdata protocol)."""
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "step": self._step,
            "epoch_done": int(self._epoch_finished()),
            "seed": self.seed,
            "batch_size": self.batch_size,
            "dp_rank": self.dp_rank,
            "dp_world": self.dp_world,
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume so the next batch is the one after the last batch handed out in ``state``.

        ``dp_rank`` may differ (Lightning saves rank 0's loop state and loads it on every
        rank; data-parallel ranks share the position). A different seed, batch size or
        data-parallel world would give a different sequence, so it is refused.
        """
        missing = {"epoch", "step"} - set(state)
        if missing:
            raise KeyError(f"loader state lacks {sorted(missing)}")
        for key in ("seed", "batch_size", "dp_world"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"loader state has {key}={state[key]!r} but this loader has "
                    f"{key}={getattr(self, key)!r}; resuming would change the batch sequence"
                )
        if state.get("fingerprint", self.fingerprint) != self.fingerprint:
            log.warning(
                "dataloader_cache: the loader state was saved with dataset fingerprint %s, "
                "this loader has %s (dataset or preprocessing changed?)",
                state.get("fingerprint"),
                self.fingerprint,
            )
        self.seek(int(state["epoch"]), int(state["step"]))
        self._done = bool(state.get("epoch_done", 0)) and self._source.num_batches() is None

    def stats(self) -> dict[str, int]:
        """Event counters: hits, misses, computed, recomputed, corrupt, evicted, epoch cache."""
        return self.counters.snapshot()

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[Any]:
        if self._closed:
            raise RuntimeError("CachedLoader is closed")
        if self._epoch_finished():
            self.seek(self._epoch + 1, 0)
        return _Iterator(self)

    def _next_batch(self) -> Any:
        if self._epoch_finished():
            raise StopIteration
        epoch, step = self._epoch, self._step
        head = (epoch, step)
        if head not in self._inflight:
            self._submit(epoch, step)  # cold start: the head alone, nothing competes with it
        fut = self._inflight.pop(head)
        try:
            result = fut.result()
        except BaseException:
            self._drop_outside_window()
            raise
        if result is END:
            self._done = True
            self._drop_outside_window()
            raise StopIteration
        self._step = step + 1
        self.counters.add("batches_served")
        self._fill_window()
        return result

    def _in_window(self, epoch: int, step: int) -> bool:
        end = self._step + max(self.config.prefetch, 1)
        return epoch == self._epoch and self._step <= step < end

    def _fill_window(self) -> None:
        """Keep ``prefetch`` batches (from the next one on) in preparation."""
        if self._executor is None:
            return
        n = self._source.num_batches()
        end = self._step + self.config.prefetch
        if n is not None:
            end = min(end, n)
        for s in range(self._step, end):
            if (self._epoch, s) not in self._inflight:
                self._submit(self._epoch, s)

    def _submit(self, epoch: int, step: int) -> None:
        fut: Future[Any]
        if self._executor is None:
            fut = Future()
            try:
                fut.set_result(self._produce(epoch, step))
            except BaseException as e:
                fut.set_exception(e)
        else:
            fut = self._executor.submit(self._produce, epoch, step)
        self._inflight[(epoch, step)] = fut

    def _drop_outside_window(self) -> None:
        for key in [k for k in self._inflight if not self._in_window(*k) or self._done]:
            self._inflight.pop(key).cancel()  # running ones finish into the cache

    def _produce(self, epoch: int, step: int) -> Any:
        """The batch ``(epoch, step)``: one part per hosted rank, joined. Runs in a worker."""
        if self._join is None:
            return self._produce_part(epoch, step, 0)
        return self._join([self._produce_part(epoch, step, i) for i in range(len(self.ranks))])

    def _produce_part(self, epoch: int, step: int, part: int) -> Any:
        """Rank ``self.ranks[part]``'s batch: cache lookup, else build, write to the
        cache, return."""
        key = BatchKey(self.fingerprint, epoch, self.ranks[part], step)
        status = None
        if self.node_cache is not None:
            status, batch = self.node_cache.lookup(key)
            if status == HIT:
                return batch
        frame: Frame | bytearray | None = None
        if self._pool is not None:
            frame, delta = self._pool.compute(epoch, step, part)
            self.counters.merge(delta)
            try:
                batch = decode(frame)
            except CorruptEntryError as e:  # a pipe does not flip bits; a codec bug would
                raise RuntimeError(f"worker returned an undecodable batch: {e}") from e
        else:
            batch = self._parts[part].compute(epoch, step)
            if batch is END:
                return END
        self.counters.add("computed")
        if status == CORRUPT:
            self.counters.add("recomputed")
        if self.node_cache is not None:
            if frame is None:
                frame = encode(batch)
            self.node_cache.put(key, frame)
        return batch

    # ------------------------------------------------------------------ hosting
    def host_refusal(self) -> str | None:
        """Why this loader cannot hand out other ranks' batches (:meth:`host`), or None."""
        if self.iterable:
            return ("its CachedLoader reads an iterable dataset, whose stream is split by "
                    "rank as it is read, so it cannot hand out other ranks' batches")
        return None

    def host(self, ranks: Sequence[int], dp_world: int,
             join: Callable[[list[Any]], Any]) -> None:
        """Hand out, per step, ``join`` of the batches that data-parallel ranks ``ranks``
        of a ``dp_world``-rank world get (a job that shrank trains on fewer ranks, each
        taking the data of retired ranks as well as its own). Each rank's part is built,
        cached and replayed as that rank's own loader would, and the position stays one
        ``(epoch, step)``, so a state saved by any of those loaders (same seed, batch size
        and ``dp_world``) loads. Call it before iterating: the workers restart."""
        if (why := self.host_refusal()) is not None:
            raise ValueError(why)
        ranks = tuple(int(r) for r in ranks)
        if not ranks or any(not 0 <= r < dp_world for r in ranks):
            raise ValueError(f"ranks {list(ranks)} are not ranks of a {dp_world}-rank world")
        for fut in self._inflight.values():
            fut.cancel()
        self._inflight.clear()
        self._finalizer()  # the workers and processes built for the previous ranks
        self.dp_rank, self.dp_world, self.ranks = ranks[0], int(dp_world), ranks
        self._join = join if len(ranks) > 1 else None
        self._set_fingerprint(self._fingerprint_given)
        n_threads = self._build_source(self._worker_mode_given)
        self._start_workers(self._worker_mode_given, n_threads)

    # ------------------------------------------------------------------ lifecycle
    def close(self, cleanup: bool = False) -> None:
        """Stop the workers. ``cleanup=True`` also deletes this job's node cache.

        Only the owner of the cache (one process per node, at the end of the run) should
        clean up: a replacement worker still needs the entries while the job runs.
        """
        if self._closed:
            return
        self._closed = True
        for fut in self._inflight.values():
            fut.cancel()
        self._inflight.clear()
        self._finalizer()
        if cleanup and self.node_cache is not None:
            self.node_cache.cleanup()

    def __enter__(self) -> CachedLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _shutdown(executor: ThreadPoolExecutor | None, pool: ProcessPool | None) -> None:
    if executor is not None:
        executor.shutdown(wait=True, cancel_futures=True)
    if pool is not None:
        pool.close()
