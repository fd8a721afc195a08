"""Writing one rank's snapshot as a DCP checkpoint, and committing the step.

:class:`RankSaver` is the I/O half of the durable writer. It runs either on the
writer's thread or, by default, in the writer's helper process (see
:mod:`replication.durable.worker`), and is the same code in both places. Given a
snapshot (staged, or read in place from its snapshot slot) it:

1. skips the step if it already has a manifest (a re-run after a rollback);
2. writes ``step_<N>/rank_<r>/`` (DCP, ``no_dist=True``: never a collective) and the
   sidecar, then ``rank_<r>.done.json`` with every file's size and checksum; a failed
   attempt removes what it wrote and is retried with exponential backoff. A snapshot
   read in place is checked against its segment digests after its data is written and
   before the done file is: a corrupted snapshot, or one overwritten mid-write, is
   never committed (and never retried);
3. if every rank's done file is now present (and from this run), writes
   ``MANIFEST.json`` atomically, last; then applies retention.
"""

from __future__ import annotations

import dataclasses
import logging
import posixpath
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from replication.durable import catalog
from replication.durable.format import (
    MANIFEST,
    SIDECAR,
    DurableError,
    FileRecord,
    Manifest,
    RankRecord,
    Sidecar,
    done_name,
    dumps,
    loads,
    persisted_digests,
    rank_dirname,
    step_dir,
    tensor_keys,
    with_digests,
)
from replication.durable.storage import (
    Progress,
    SaveAborted,
    display_url,
    fsync_dir,
    resolve,
    rm_quiet,
    write_atomic,
    write_plain,
)
from replication.snapshots.checksum import ChecksumMismatch
from replication.snapshots.digest_copy import verify_segments
from replication.training_state import codec
from replication.training_state.snapshot_meta import SnapshotError, SnapshotMeta

log = logging.getLogger("checkpointless.durable")

warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)

OK, SKIPPED, FAILED, EXISTS, ABORTED = "ok", "skipped", "failed", "exists", "aborted"
STAGE_HEADER = 64  # shared staging buffer: int64 "bytes staged so far", then the snapshot


def unverified(why: object) -> str:
    """The error of a save refused because the snapshot failed its digests."""
    return f"snapshot failed verification before persisting: {why}"


@dataclass
class SaveResult:
    """The outcome of one submitted step on this rank."""

    step: int
    rank: int
    status: str  # ok | skipped | failed | exists | aborted
    nbytes: int = 0
    duration_s: float = 0.0
    attempts: int = 0
    cpu_s: float = 0.0  # CPU time the saving thread spent on it (user + system)
    committed: bool = False  # this rank wrote the manifest (the checkpoint is visible)
    url: str = ""
    error: str = ""

    @property
    def throughput_MBps(self) -> float:
        return self.nbytes / self.duration_s / 1e6 if self.duration_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SaverSettings:
    """Everything a :class:`RankSaver` needs; plain data, so it can cross to a process."""

    path: str
    storage_options: dict
    rank: int
    world_size: int
    run_id: str
    keep_last: int
    prune: bool = True
    retries: int = 3
    backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    progress_interval_s: float = 10.0
    max_write_mbps: float = 0.0


class RankSaver:
    """Persists staged snapshots of one rank (see the module docstring)."""

    def __init__(self, settings: SaverSettings) -> None:
        self.s = settings
        self.rank, self.world_size = settings.rank, settings.world_size
        self.run_id = settings.run_id
        self.fs, self.root = resolve(settings.path, settings.storage_options)
        self.url = display_url(self.fs, self.root)
        self.progress: Progress | None = None

    def save(
        self,
        meta: SnapshotMeta,
        buf: torch.Tensor,
        abort: threading.Event,
        wait_staged: Callable[[int], None] | None = None,
        *,
        verify: bool = False,
    ) -> SaveResult:
        """Persist ``(meta, buf)``; ``meta.digests`` must describe the bytes as persisted.

        ``wait_staged(end)``, if given, blocks until ``buf[:end]`` holds its final bytes
        (the buffer is still being filled while the save starts).

        ``verify=True``: ``buf`` is the snapshot itself, read in place, and ``meta`` its
        own metadata. The digests of the bytes as persisted (alignment padding zeroed)
        are derived here, and ``buf`` is checked against ``meta``'s segment digests
        after the data files are written, before the done file: a check *after* the
        write also catches a buffer that changed while it was being written.
        """
        step = meta.step
        check = meta if verify else None
        t0, cpu0 = time.monotonic(), time.thread_time()
        result = SaveResult(step, self.rank, FAILED, url=posixpath.join(self.url, f"step_{step}"))
        try:
            sdir = step_dir(self.root, step)
            if self._exists(posixpath.join(sdir, MANIFEST)):
                result.status, result.error = EXISTS, "step already persisted"
                return result
            self.fs.makedirs(self.root, exist_ok=True)
            if check is not None:
                meta = with_digests(check, persisted_digests(buf, check))
            status, nbytes, err = self._retry(
                result, "write",
                lambda: self._write_rank(sdir, meta, buf, abort, wait_staged, check), abort)
            result.status, result.error = status, err
            if status != OK:
                return result
            result.nbytes = int(nbytes)
            status, wrote, err = self._retry(
                result, "commit", lambda: self._try_commit(sdir, step), abort)
            result.committed = status == OK and bool(wrote)
            if status != OK:  # our files are durable; another rank may still commit
                result.error = err
                log.error("rank %d could not check or write the manifest of step %d: %s",
                          self.rank, step, err)
        finally:
            result.duration_s = time.monotonic() - t0
            result.cpu_s = time.thread_time() - cpu0
        if result.status == OK:
            log.info("persisted step %d (rank %d): %.1f MB in %.2fs (%.0f MB/s)%s", step,
                     self.rank, result.nbytes / 1e6, result.duration_s, result.throughput_MBps,
                     "; checkpoint committed" if result.committed else "")
        if result.committed and self.s.prune:
            self.prune()
        return result

    # -- attempts -----------------------------------------------------------------------
    def _retry(
        self, result: SaveResult, what: str, fn: Callable[[], Any], abort: threading.Event
    ) -> tuple[str, Any, str]:
        """Run ``fn`` with retries and exponential backoff: (status, value, error)."""
        from replication.durable.dcp_io import CheckpointException

        delay = self.s.backoff_s
        for attempt in range(1, self.s.retries + 2):
            if what == "write":
                result.attempts += 1
            try:
                return OK, fn(), ""
            except SaveAborted as exc:
                self.cleanup(result.step)
                return ABORTED, None, f"{what}: {exc}"
            except (ChecksumMismatch, SnapshotError) as exc:  # the same bytes fail again
                self.cleanup(result.step)
                log.error("rank %d refused to persist step %d: %s", self.rank, result.step,
                          exc)
                return FAILED, None, unverified(exc)
            except (Exception, CheckpointException) as exc:  # CheckpointException: BaseException
                err = f"{what}: {_describe(exc)}"
                if what == "write":
                    self.cleanup(result.step)
                if abort.is_set():  # torch.save may re-raise our abort as RuntimeError
                    return ABORTED, None, f"{what}: aborted, the writer is closing ({err})"
                if attempt > self.s.retries:
                    return FAILED, None, err
                log.warning("durable %s of step %d failed on rank %d (attempt %d of %d): %s; "
                            "retrying in %.1fs", what, result.step, self.rank, attempt,
                            self.s.retries + 1, err, delay)
                if abort.wait(delay):
                    return ABORTED, None, f"{err} (writer closing)"
                delay = min(delay * 2, self.s.max_backoff_s)
        raise AssertionError("unreachable")  # pragma: no cover

    def cleanup(self, step: int) -> None:
        """Remove this rank's files of ``step`` (a failed or aborted attempt)."""
        sdir = step_dir(self.root, step)
        rm_quiet(self.fs, posixpath.join(sdir, done_name(self.rank)))
        rm_quiet(self.fs, posixpath.join(sdir, rank_dirname(self.rank)), recursive=True)

    def _exists(self, path: str) -> bool:
        try:
            self.fs.invalidate_cache(posixpath.dirname(path))
            return bool(self.fs.exists(path))
        except Exception:
            return False

    # -- writing --------------------------------------------------------------------------
    def _write_rank(
        self,
        sdir: str,
        meta: SnapshotMeta,
        buf: torch.Tensor,
        abort: threading.Event,
        wait_staged: Callable[[int], None] | None = None,
        check: SnapshotMeta | None = None,
    ) -> int:
        """Write this rank's DCP checkpoint, sidecar and done file; returns bytes written.

        ``check``: verify ``buf`` against these digests before writing the done file."""
        import torch.distributed.checkpoint as dcp

        from replication.durable.dcp_io import (
            CheckpointException,
            RankWriter,
            StagedSavePlanner,
            Tracker,
        )

        rname = rank_dirname(self.rank)
        rdir = posixpath.join(sdir, rname)
        self.cleanup(meta.step)
        self.fs.makedirs(rdir, exist_ok=True)
        label = f"persisting step {meta.step} (rank {self.rank})"
        progress = Progress(label, meta.layout.nbytes, self.s.progress_interval_s,
                            self.s.max_write_mbps * 1e6, abort=abort)
        self.progress = progress
        tracker = Tracker(progress)
        keys = tensor_keys(meta)
        flat: dict[str, Any] = tensor_dict(buf, meta, keys)
        flat.update(plain_values(buf, meta, set(flat)))
        ends = {key: seg.offset + spec.offset + spec.nbytes for seg in meta.layout.segments
                for spec, key in zip(seg.tensors, keys[seg.name])}
        try:
            dcp.save(flat, storage_writer=RankWriter(self.fs, rdir, tracker),
                     planner=StagedSavePlanner(wait_staged, ends), no_dist=True)
        except CheckpointException as exc:
            cause = _root(exc)
            if isinstance(cause, SaveAborted):
                raise cause from None
            raise
        side = write_plain(self.fs, posixpath.join(rdir, SIDECAR),
                           Sidecar(self.rank, meta, keys).to_bytes())
        fsync_dir(self.fs, rdir)
        if check is not None:
            verify_segments(buf, check)
        files = {f"{rname}/{posixpath.basename(p)}": FileRecord(
            f"{rname}/{posixpath.basename(p)}", size, digest)
            for p, (size, digest) in tracker.files.items()}
        files[f"{rname}/{SIDECAR}"] = FileRecord(f"{rname}/{SIDECAR}", side.size, side.digest)
        record = RankRecord(
            rank=self.rank, world_size=self.world_size, step=meta.step, run_id=self.run_id,
            files=files, segments=dict(meta.digests),
            nbytes=sum(f.size for f in files.values()), finished_unix=round(time.time(), 3),
        )
        write_atomic(self.fs, posixpath.join(sdir, done_name(self.rank)),
                     dumps(record.to_json()))
        return record.nbytes

    def _try_commit(self, sdir: str, step: int) -> bool:
        """Write the manifest if every rank is done; True if this call wrote it."""
        manifest_path = posixpath.join(sdir, MANIFEST)
        self.fs.invalidate_cache(sdir)
        names = {posixpath.basename(p) for p in self.fs.ls(sdir, detail=False)}
        if MANIFEST in names:
            return False
        if not all(done_name(r) in names for r in range(self.world_size)):
            return False
        records = []
        for r in range(self.world_size):
            what = f"{sdir}/{done_name(r)}"
            try:
                rec = RankRecord.from_json(loads(self.fs.cat_file(posixpath.join(
                    sdir, done_name(r))), what), what)
            except (DurableError, FileNotFoundError) as exc:
                log.warning("not committing step %d: %s", step, exc)
                return False
            if (rec.rank, rec.step, rec.world_size, rec.run_id) != (
                r, step, self.world_size, self.run_id
            ):
                log.warning("not committing step %d: %s is from another run or world "
                            "(run %r, world %d)", step, what, rec.run_id, rec.world_size)
                return False
            records.append(rec)
        present = {posixpath.relpath(p, sdir): info.get("size")
                   for p, info in self.fs.find(sdir, detail=True).items()}
        for rec in records:
            for rel, f in rec.files.items():
                if present.get(rel) != f.size:
                    log.warning("not committing step %d: %s is missing or has the wrong size",
                                step, rel)
                    return False
        manifest = Manifest(step, self.world_size, self.run_id,
                            max(r.finished_unix for r in records), tuple(records))
        write_atomic(self.fs, manifest_path, dumps(manifest.to_json()))
        fsync_dir(self.fs, self.root)
        return True

    def prune(self) -> None:
        """Retention after a commit: keep ``keep_last``, drop older leftovers."""
        try:
            infos = [catalog.inspect_step(self.fs, self.root, s, self.url)
                     for s in catalog.step_dirs(self.fs, self.root)]
            report = catalog.prune_infos(self.fs, self.root, infos, self.s.keep_last,
                                         incomplete_grace_s=None, dry_run=False)
            if report.deleted:
                log.info("retention (keep_last=%d) removed %d checkpoint dir(s)",
                         self.s.keep_last, len(report.deleted))
        except Exception as exc:
            log.warning("retention of %s failed: %r", self.url, exc)


def tensor_dict(
    buf: torch.Tensor, meta: SnapshotMeta, keys: dict[str, list[str]]
) -> dict[str, torch.Tensor]:
    """Zero-copy tensors over ``buf``, each owning exactly its bytes.

    DCP clones any tensor whose storage is larger than the tensor (a view into a big
    buffer), which would copy the whole snapshot once more; ``torch.frombuffer`` on a
    slice gives each tensor a storage of its own size over the same memory.
    """
    mv = memoryview(buf.numpy())
    out: dict[str, torch.Tensor] = {}
    for seg in meta.layout.segments:
        for spec, key in zip(seg.tensors, keys[seg.name]):
            dtype = codec.dtype_from_name(spec.dtype)
            if spec.nbytes == 0:
                t = torch.empty(spec.shape, dtype=dtype)
            else:
                t = torch.frombuffer(mv, dtype=torch.uint8, count=spec.nbytes,
                                     offset=seg.offset + spec.offset)
                t = t.view(dtype).view(spec.shape)
            out[key] = t
    return out


def plain_values(buf: torch.Tensor, meta: SnapshotMeta, taken: set[str]) -> dict[str, Any]:
    """The state's non-tensor leaves under the keys DCP flattens them to
    (``optim.param_groups.0.lr``), so that plain ``torch.distributed.checkpoint.load``
    of a whole ``optimizer.state_dict()`` (or a scheduler's) finds every entry.

    DCP stores them as byte items (``torch.save``). Our own loader never reads them: it
    rebuilds the state from the sidecar's pickle-free skeleton, so nothing written here
    is ever unpickled by the runtime. Keys a tensor already uses, and values that hold
    tensors (DCP keeps a tuple of tensors whole), are left out.

    Only optimizer and scheduler entries get them (:func:`_is_optimizer_or_scheduler`):
    every byte item is a ``torch.save`` of its own, and a framework's loop state
    (Lightning's trainer entry: hundreds of small leaves) nearly doubled the time of a
    save (0.09 s to 0.16 s for a 400 KB Lightning state) for entries nobody loads with
    plain DCP.
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from replication.training_state.layout import unflatten_segment

    out: dict[str, Any] = {}
    for seg in meta.layout.segments:
        if not _is_optimizer_or_scheduler(codec.loads(meta.skeletons[seg.name])):
            continue
        state = unflatten_segment(buf[seg.offset: seg.offset + seg.nbytes], seg,
                                  meta.skeletons[seg.name])
        flat, _ = flatten_state_dict({seg.name: state})
        for key, value in flat.items():
            if key not in taken and not _holds_tensor(value):
                out[key] = value
    return out


#: Top-level keys that make an entry's state dict an optimizer's (``param_groups``) or a
#: learning-rate scheduler's (``last_epoch``, ``base_lrs``).
_OPTIMIZER_OR_SCHEDULER_KEYS = frozenset({"param_groups", "last_epoch", "base_lrs"})


def _is_optimizer_or_scheduler(skeleton: Any) -> bool:
    """Judged from the encoded skeleton's top-level keys, without decoding it."""
    if not isinstance(skeleton, dict) or not isinstance(skeleton.get("D"), list):
        return False
    return any(isinstance(kv, list) and len(kv) == 2 and kv[0] in _OPTIMIZER_OR_SCHEDULER_KEYS
               for kv in skeleton["D"])


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple, set)):
        return any(_holds_tensor(v) for v in value)
    return False


def _root(exc: BaseException) -> BaseException:
    failures = getattr(exc, "failures", None)  # DCP's CheckpointException
    if isinstance(failures, dict):
        for err, _tb in failures.values():
            return _root(err)
    return exc


def _describe(exc: BaseException) -> str:
    cause = _root(exc)
    return f"{type(cause).__name__}: {cause}"[:400]
