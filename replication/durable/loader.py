"""Loading durable checkpoints back into live objects, verified first.

Order of trust: the manifest (JSON) names every file with its size and checksum; the
files of the ranks to be read are re-hashed before any of them is parsed; DCP's
pickled ``.metadata`` is then read with an allow-list, the tensors with DCP's reader
(``torch.load(weights_only=True)``) into a fresh zeroed buffer laid out as the
snapshot was, and every segment's snapshot digest (bytes, skeleton and layout) is
checked before anything is decoded. Only then are the live objects touched, so a bad
checkpoint raises and leaves the training state as it was.

Resharding: a checkpoint holds one DCP checkpoint per rank of the world that wrote it.
Loading at the same world size reads each rank's own files. At another world size,
segments that were identical on every rank (data-parallel model and optimizer state:
the manifest lists them) are read from rank 0's files; per-rank state that differs
(FSDP/DTensor shards, per-rank RNG streams, sampler positions) cannot be resharded in
this format, and :func:`load` refuses unless ``source_rank`` names whose copy to take.
"""

from __future__ import annotations

import logging
import posixpath
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from replication.durable.catalog import (
    CheckpointInfo,
    ensure_intact,
    list_checkpoints,
    open_checkpoint,
)
from replication.durable.format import (
    SIDECAR,
    CorruptCheckpoint,
    DurableError,
    Sidecar,
    load_dcp_metadata,
    rank_dirname,
)
from replication.durable.storage import resolve
from replication.snapshots.checksum import ChecksumMismatch
from replication.snapshots.digest_copy import segment_digest
from replication.training_state import codec
from replication.training_state.layout import segment_views, unflatten_segment
from replication.training_state.snapshot_meta import SnapshotMeta
from replication.training_state.state import TrainingState

log = logging.getLogger("checkpointless.durable")

warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


@dataclass
class LoadResult:
    """What :func:`load` restored, and from where."""

    url: str
    step: int
    world_size: int  # of the checkpoint
    sources: dict[str, int]  # segment -> rank whose files it came from
    nbytes: int
    duration_s: float
    fallbacks: list[tuple[int, str]] = field(default_factory=list)  # (step, why skipped)


def plan_sources(
    info: CheckpointInfo,
    names: list[str],
    rank: int,
    world_size: int | None,
    source_rank: int | None,
) -> dict[str, int]:
    """Which rank's files each segment is read from (see the module docstring)."""
    manifest = info.manifest
    assert manifest is not None
    old = manifest.world_size
    if source_rank is not None:
        if not 0 <= source_rank < old:
            raise DurableError(f"source_rank {source_rank} is not a rank of {info.url} "
                               f"(world size {old})")
        sources = dict.fromkeys(names, source_rank)
    elif world_size in (None, old):
        if not 0 <= rank < old:
            raise DurableError(f"rank {rank} is not a rank of {info.url} (world size {old})")
        sources = dict.fromkeys(names, rank)
    else:
        identical = set(manifest.identical_segments)
        differ = [n for n in names if n not in identical]
        if differ:
            raise DurableError(
                f"cannot load rank {rank} of {world_size} from {info.url}, written by {old} "
                f"rank(s): state {differ} differs between ranks, so it is not data-parallel "
                "and this format cannot reshard it; pass source_rank=R to take rank R's copy"
            )
        sources = dict.fromkeys(names, 0)
    for name, src in sources.items():
        if name not in manifest.rank(src).segments:
            raise DurableError(f"checkpoint {info.url} has no state {name!r} "
                               f"(it holds {sorted(manifest.rank(src).segments)})")
    return sources


def read_rank(
    info: CheckpointInfo,
    rank: int,
    names: list[str] | None = None,
    storage_options: dict | None = None,
) -> tuple[SnapshotMeta, torch.Tensor]:
    """Read rank ``rank``'s snapshot (segments ``names``, default all) into a new buffer.

    Returns the snapshot metadata (digests of the persisted bytes) and a zeroed buffer
    laid out like the original snapshot, with the named segments filled and verified.
    Does not re-hash files: call :func:`ensure_intact` first for untrusted storage.
    """
    import torch.distributed.checkpoint as dcp

    from replication.durable.dcp_io import CheckpointException, RankReader, TensorOnlyLoadPlanner

    opts = storage_options if storage_options is not None else info.storage_options
    manifest = info.manifest
    assert manifest is not None
    fs, sdir = resolve(info.url, opts)
    rdir = posixpath.join(sdir, rank_dirname(rank))
    where = f"{info.url}/{rank_dirname(rank)}"
    sidecar = Sidecar.from_bytes(fs.cat_file(posixpath.join(rdir, SIDECAR)), f"{where}/{SIDECAR}")
    meta = sidecar.meta
    if sidecar.rank != rank or meta.step != info.step:
        raise CorruptCheckpoint(f"{where}/{SIDECAR} is for rank {sidecar.rank} step {meta.step}")
    record = manifest.rank(rank)
    wanted = [s for s in meta.layout.segments if names is None or s.name in names]
    for seg in wanted:
        if record.segments.get(seg.name) != meta.digests[seg.name]:
            raise CorruptCheckpoint(f"{where}: segment {seg.name!r} digest differs from manifest")
    md = load_dcp_metadata(fs.cat_file(posixpath.join(rdir, ".metadata")), f"{where}/.metadata")
    buffer = torch.zeros(meta.layout.nbytes, dtype=torch.uint8)
    flat: dict[str, torch.Tensor] = {}
    for seg in wanted:
        views = segment_views(buffer[seg.offset : seg.offset + seg.nbytes], seg)
        flat.update(zip(sidecar.keys[seg.name], views))
    try:
        dcp.load(flat, storage_reader=RankReader(fs, rdir, md),
                 planner=TensorOnlyLoadPlanner(), no_dist=True)
    except CheckpointException as exc:
        raise CorruptCheckpoint(f"{where}: DCP could not read it: {_cause(exc)}") from None
    except (RuntimeError, ValueError, KeyError, EOFError) as exc:
        raise CorruptCheckpoint(f"{where}: DCP could not read it: {exc!r}"[:400]) from None
    for seg in wanted:
        got = segment_digest(buffer[seg.offset : seg.offset + seg.nbytes], seg,
                             meta.skeletons[seg.name])
        if got != meta.digests[seg.name]:
            raise CorruptCheckpoint(
                f"{where}: segment {seg.name!r} checksum {got} != recorded {meta.digests[seg.name]}"
            )
    return meta, buffer


def read_segments(
    info: CheckpointInfo,
    rank: int,
    names: list[str] | None,
    *,
    verify: bool = True,
    storage_options: dict | None = None,
) -> dict[str, Any]:
    """Decoded state dicts of rank ``rank``'s segments (tensors alias a private buffer)."""
    if verify:
        ensure_intact(info, [rank], storage_options)
    meta, buffer = read_rank(info, rank, names, storage_options)
    states = {}
    for seg in meta.layout.segments:
        if names is not None and seg.name not in names:
            continue
        try:
            states[seg.name] = unflatten_segment(
                buffer[seg.offset : seg.offset + seg.nbytes], seg, meta.skeletons[seg.name]
            )
        except codec.CodecError as exc:
            raise CorruptCheckpoint(f"{info.url}: segment {seg.name!r} cannot be decoded: "
                                    f"{exc}") from None
    return states


def read_snapshot(
    where: str | CheckpointInfo,
    rank: int = 0,
    *,
    verify: bool = True,
    storage_options: dict | None = None,
) -> tuple[SnapshotMeta, torch.Tensor]:
    """A rank's whole snapshot as (metadata, buffer), e.g. to seed the in-memory tier."""
    info = open_checkpoint(where, storage_options)
    if verify:
        ensure_intact(info, [rank], storage_options)
    return read_rank(info, rank, None, storage_options)


def load(
    where: str | CheckpointInfo,
    state: TrainingState,
    *,
    rank: int = 0,
    world_size: int | None = None,
    source_rank: int | None = None,
    verify: bool = True,
    storage_options: dict | None = None,
) -> LoadResult:
    """Restore ``state`` from a checkpoint (a :class:`CheckpointInfo`, a ``step_<N>`` URL,
    or a persistence root, meaning its newest valid checkpoint).

    ``rank``/``world_size`` describe the loading process; ``world_size=None`` means the
    checkpoint's. With ``verify`` every file read is re-hashed against the manifest
    first. Raises :class:`CorruptCheckpoint` for damaged data, :class:`DurableError`
    when the checkpoint cannot serve this rank; the live state is untouched then.
    """
    t0 = time.monotonic()
    info = open_checkpoint(where, storage_options)
    opts = storage_options if storage_options is not None else info.storage_options
    assert info.manifest is not None
    held = set(info.manifest.rank(0).segments)  # every rank registers the same entries
    names = [n for n in state.names() if n in held or n not in state.optional]
    sources = plan_sources(info, names, rank, world_size, source_rank)
    ranks = sorted(set(sources.values()))
    log.info("loading durable checkpoint %s (step %d) for rank %d from rank(s) %s",
             info.url, info.step, rank, ranks)
    if verify:
        ensure_intact(info, ranks, opts)
    states: dict[str, Any] = {}
    nbytes = 0
    for src in ranks:
        mine = [n for n, s in sources.items() if s == src]
        states.update(read_segments(info, src, mine, verify=False, storage_options=opts))
        nbytes += info.manifest.rank(src).nbytes if info.manifest else 0
    try:
        state.restore(states)
    except ChecksumMismatch as exc:  # pragma: no cover - verified above
        raise CorruptCheckpoint(str(exc)) from None
    dt = time.monotonic() - t0
    log.info("loaded step %d from %s: %.1f MB in %.2fs (%.0f MB/s)", info.step, info.url,
             nbytes / 1e6, dt, nbytes / max(dt, 1e-9) / 1e6)
    assert info.manifest is not None
    return LoadResult(info.url, info.step, info.manifest.world_size, sources, nbytes, dt)


def load_latest(
    url: str,
    state: TrainingState,
    *,
    rank: int = 0,
    world_size: int | None = None,
    source_rank: int | None = None,
    verify: bool = True,
    storage_options: dict | None = None,
) -> LoadResult:
    """Restore the newest checkpoint under ``url`` that passes verification.

    A corrupted or unreadable newer checkpoint is skipped with a warning naming it and
    the reason, and the previous one is tried; the result lists every fallback.
    Raises :class:`DurableError` if no checkpoint can be loaded.
    """
    fallbacks: list[tuple[int, str]] = []
    for info in reversed(list_checkpoints(url, storage_options)):
        try:
            result = load(info, state, rank=rank, world_size=world_size,
                          source_rank=source_rank, verify=verify,
                          storage_options=storage_options)
        except (CorruptCheckpoint, OSError) as exc:
            log.warning("durable checkpoint of step %d at %s is unusable (%s); falling back "
                        "to an older one", info.step, info.url, exc)
            fallbacks.append((info.step, str(exc)))
            continue
        result.fallbacks = fallbacks
        if fallbacks:
            log.warning("restored step %d after skipping corrupted step(s) %s", result.step,
                        [s for s, _ in fallbacks])
        return result
    detail = f"; skipped: {fallbacks}" if fallbacks else ""
    raise DurableError(f"no loadable checkpoint under {url}{detail}")


def _cause(exc: BaseException) -> str:
    for _rank, (err, _tb) in getattr(exc, "failures", {}).items():
        return repr(err)[:300]
    return str(exc)[:300]
