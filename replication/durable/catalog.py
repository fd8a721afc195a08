"""Finding, checking and pruning durable checkpoints.

A step directory is **valid** when its ``MANIFEST.json`` parses and every file it lists
exists with the recorded size; that is a cheap listing, one per step directory.
:func:`verify` goes further and re-hashes every byte. Anything else under a
``step_<N>`` name is **incomplete** (no manifest: a save in progress, or one that
died) or **damaged** (a manifest whose files are missing or the wrong size); neither
is ever returned by :func:`list_checkpoints`.
"""

from __future__ import annotations

import datetime
import logging
import posixpath
import time
from dataclasses import dataclass, field
from typing import Any

import fsspec

from replication.durable.format import (
    LAYOUT_DCP,
    MANIFEST,
    CorruptCheckpoint,
    DurableError,
    Manifest,
    loads,
    parse_step,
    step_dir,
)
from replication.durable.storage import display_url, hash_file, resolve, rm_quiet

log = logging.getLogger("checkpointless.durable")

VALID, INCOMPLETE, DAMAGED = "valid", "incomplete", "damaged"


@dataclass(frozen=True)
class CheckpointInfo:
    """One step directory of a persistence root, valid or not."""

    url: str  # the step directory, as a URL (a plain path on local storage)
    root: str  # the persistence root, as given
    step: int
    status: str  # valid | incomplete | damaged
    reason: str = ""
    manifest: Manifest | None = None
    nbytes: int = 0  # bytes present in the directory
    mtime: float = 0.0  # newest file's modification time (0 if unknown)
    storage_options: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def valid(self) -> bool:
        return self.status == VALID

    @property
    def world_size(self) -> int:
        return self.manifest.world_size if self.manifest else 0

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "step": self.step, "url": self.url, "status": self.status, "bytes": self.nbytes,
        }
        if self.reason:
            doc["reason"] = self.reason
        if self.manifest is not None:
            doc.update(
                world_size=self.manifest.world_size,
                run_id=self.manifest.run_id,
                created_unix=self.manifest.created_unix,
                identical_segments=self.manifest.identical_segments,
                files=len(self.manifest.files),
            )
        return doc


def _mtime(info: dict[str, Any]) -> float:
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        v = info.get(key)
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, datetime.datetime):
            return v.timestamp()
        if isinstance(v, str):
            try:
                return datetime.datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return 0.0


def inspect_step(
    fs: fsspec.AbstractFileSystem, root: str, step: int, url_root: str = "",
    storage_options: dict | None = None,
) -> CheckpointInfo:
    """Classify one step directory (one listing, one small read)."""
    return inspect_dir(fs, step_dir(root, step), step, url_root or display_url(fs, root),
                       storage_options)


def inspect_dir(
    fs: fsspec.AbstractFileSystem, sdir: str, step: int | None, url_root: str,
    storage_options: dict | None = None,
) -> CheckpointInfo:
    """Classify one checkpoint directory: a ``step_<N>`` one (``step``), or one named by
    a tag (``step=None``: its manifest says the step; :mod:`replication.durable.tagged`)."""
    base = dict(url=display_url(fs, sdir), root=url_root, step=-1 if step is None else step,
                storage_options=dict(storage_options or {}))
    try:
        found = fs.find(sdir, detail=True)
    except FileNotFoundError:
        found = {}
    rel = {posixpath.relpath(p, sdir): info for p, info in found.items()}
    nbytes = sum(int(i.get("size") or 0) for i in rel.values())
    mtime = max((_mtime(i) for i in rel.values()), default=0.0)
    if not rel:  # an empty directory (a save that has only just begun): its own time
        try:
            mtime = _mtime(fs.info(sdir))
        except (FileNotFoundError, OSError):
            pass
    base.update(nbytes=nbytes, mtime=mtime)
    if MANIFEST not in rel:
        return CheckpointInfo(status=INCOMPLETE, reason="no manifest", **base)
    try:
        manifest = Manifest.from_json(
            loads(fs.cat_file(posixpath.join(sdir, MANIFEST)), f"{base['url']}/{MANIFEST}"),
            f"{base['url']}/{MANIFEST}",
        )
    except FileNotFoundError:  # removed since the listing: being pruned
        return CheckpointInfo(status=INCOMPLETE, reason="manifest vanished", **base)
    except DurableError as exc:
        return CheckpointInfo(status=DAMAGED, reason=str(exc), **base)
    if step is None:
        base["step"] = manifest.step
    elif manifest.step != step:
        return CheckpointInfo(status=DAMAGED, reason=f"manifest is for step {manifest.step}",
                              manifest=manifest, **base)
    for path, rec in sorted(manifest.files.items()):
        got = rel.get(path)
        if got is None:
            return CheckpointInfo(status=DAMAGED, reason=f"{path} is missing",
                                  manifest=manifest, **base)
        if int(got.get("size") or 0) != rec.size:
            return CheckpointInfo(
                status=DAMAGED, reason=f"{path} has {got.get('size')} bytes, manifest says "
                f"{rec.size}", manifest=manifest, **base,
            )
    return CheckpointInfo(status=VALID, manifest=manifest, **base)


def step_dirs(fs: fsspec.AbstractFileSystem, root: str) -> list[int]:
    fs.invalidate_cache(root)
    entries = fs.ls(root, detail=True)
    steps = []
    for e in entries:
        step = parse_step(e["name"])
        if step is not None and e.get("type") == "directory":
            steps.append(step)
    return sorted(set(steps))


def scan(url: str, storage_options: dict | None = None) -> list[CheckpointInfo]:
    """Every step directory under ``url``, oldest first, with its status.

    Raises :class:`DurableError` if ``url`` does not exist.
    """
    fs, root = resolve(url, storage_options)
    try:
        steps = step_dirs(fs, root)
    except FileNotFoundError:
        raise DurableError(f"{url} does not exist") from None
    except NotADirectoryError:
        raise DurableError(f"{url} is not a directory") from None
    return [inspect_step(fs, root, s, url, storage_options) for s in steps]


def find_roots(url: str, storage_options: dict | None = None) -> list[str]:
    """``url`` if it holds step directories, else those of its immediate subdirectories
    that do: a ``ModelCheckpoint`` directory holds one durable root per ``.ckpt`` name.

    Raises :class:`DurableError` if ``url`` does not exist or is not a directory.
    """
    fs, root = resolve(url, storage_options)
    try:
        if step_dirs(fs, root):
            return [url]
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        raise DurableError(f"{url} does not exist") from None
    except NotADirectoryError:
        raise DurableError(f"{url} is not a directory") from None
    roots = []
    for e in sorted(entries, key=lambda e: e["name"]):
        if e.get("type") != "directory" or parse_step(e["name"]) is not None:
            continue
        name = posixpath.basename(e["name"].rstrip("/"))
        try:
            if step_dirs(fs, posixpath.join(root, name)):
                roots.append(url.rstrip("/") + "/" + name)
        except (FileNotFoundError, NotADirectoryError):
            continue
    return roots


def newest_checkpoint(urls: list[str], storage_options: dict | None = None
                      ) -> CheckpointInfo | None:
    """The newest valid checkpoint (by manifest time) under any of ``urls`` and their
    immediate subdirectories (see :func:`find_roots`); ``None`` if there is none."""
    best: CheckpointInfo | None = None
    for url in urls:
        try:
            roots = find_roots(url, storage_options)
        except DurableError:
            continue
        for root in roots:
            info = latest_checkpoint(root, storage_options)
            if info is None or info.manifest is None:
                continue
            if best is None or _created(info) > _created(best):
                best = info
    return best


def _created(info: CheckpointInfo) -> float:
    return (info.manifest.created_unix if info.manifest else 0.0) or info.mtime


def list_checkpoints(url: str, storage_options: dict | None = None) -> list[CheckpointInfo]:
    """The valid checkpoints under ``url``, oldest first ([] if there is nothing yet)."""
    try:
        return [c for c in scan(url, storage_options) if c.valid]
    except DurableError:
        return []


def latest_checkpoint(url: str, storage_options: dict | None = None) -> CheckpointInfo | None:
    """The newest valid checkpoint under ``url``, or ``None``."""
    ckpts = list_checkpoints(url, storage_options)
    return ckpts[-1] if ckpts else None


def open_checkpoint(
    where: str | CheckpointInfo, storage_options: dict | None = None
) -> CheckpointInfo:
    """A checkpoint from a :class:`CheckpointInfo`, a step directory URL, or a root URL
    (its newest valid checkpoint). Raises :class:`DurableError` if none is valid."""
    if isinstance(where, CheckpointInfo):
        if not where.valid:
            raise DurableError(f"checkpoint {where.url} is {where.status}: {where.reason}")
        return where
    opts = storage_options or {}
    fs, path = resolve(where, opts)
    step = parse_step(path)
    if step is not None:
        info = inspect_step(fs, posixpath.dirname(path), step, storage_options=opts)
        if not info.valid:
            raise DurableError(f"checkpoint {info.url} is {info.status}: {info.reason}")
        return info
    if is_tagged(fs, path):  # a framework's own layout, committed with a manifest
        info = inspect_dir(fs, path, None, display_url(fs, posixpath.dirname(path)), opts)
        if not info.valid:
            raise DurableError(f"checkpoint {info.url} is {info.status}: {info.reason}")
        return info
    latest = latest_checkpoint(where, opts)
    if latest is None:
        raise DurableError(f"no valid checkpoint under {where}")
    return latest


def is_tagged(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    """``path`` is a checkpoint directory named by a tag: it holds a manifest itself."""
    return parse_step(path) is None and fs.exists(posixpath.join(path, MANIFEST))


@dataclass
class VerifyReport:
    """The outcome of re-hashing a checkpoint's files (and, if deep, its segments)."""

    url: str
    step: int
    ok: bool
    files_checked: int = 0
    nbytes: int = 0
    duration_s: float = 0.0
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url, "step": self.step, "ok": self.ok, "files": self.files_checked,
            "bytes": self.nbytes, "duration_s": round(self.duration_s, 3),
            "problems": self.problems,
        }


def verify(
    ckpt: str | CheckpointInfo,
    storage_options: dict | None = None,
    *,
    ranks: list[int] | None = None,
    deep: bool = False,
    progress_interval_s: float = 10.0,
) -> VerifyReport:
    """Re-hash every file of ``ckpt`` (or of ``ranks`` only) against its manifest.

    ``deep`` also loads each rank's tensors through DCP and checks the per-segment
    snapshot digests (the bytes the training process held). Never raises for damage:
    the report lists every problem found.
    """
    from replication.durable.storage import Progress

    info = ckpt if isinstance(ckpt, CheckpointInfo) else None
    opts = storage_options
    if opts is None:
        opts = info.storage_options if info else {}
    t0 = time.monotonic()
    if info is None:
        fs, path = resolve(ckpt, opts)  # type: ignore[arg-type]
        step = parse_step(path)
        if step is None and not is_tagged(fs, path):
            raise DurableError(f"{ckpt} is not a checkpoint directory (step_<N>, or a "
                               f"tagged one with a {MANIFEST})")
        parent = posixpath.dirname(path)
        info = (inspect_step(fs, parent, step, storage_options=opts) if step is not None
                else inspect_dir(fs, path, None, display_url(fs, parent), opts))
    fs, sdir = resolve(info.url, opts)
    report = VerifyReport(info.url, info.step, ok=True)
    if info.manifest is None:
        report.ok = False
        report.problems.append(f"{info.status}: {info.reason}")
        return report
    if not info.valid:
        report.problems.append(f"{info.status}: {info.reason}")
    manifest = info.manifest
    wanted = set(range(manifest.world_size)) if ranks is None else set(ranks)
    files = {k: v for r in manifest.ranks if r.rank in wanted for k, v in r.files.items()}
    prog = Progress(f"verifying {info.url}", sum(f.size for f in files.values()),
                    progress_interval_s)
    for rel, rec in sorted(files.items()):
        try:
            size, digest = hash_file(fs, posixpath.join(sdir, rel), prog.add)
        except FileNotFoundError:
            report.problems.append(f"{rel}: missing")
            continue
        except OSError as exc:
            report.problems.append(f"{rel}: unreadable ({exc})")
            continue
        report.files_checked += 1
        report.nbytes += size
        if size != rec.size:
            report.problems.append(f"{rel}: {size} bytes, manifest says {rec.size}")
        elif digest != rec.digest:
            report.problems.append(f"{rel}: checksum {digest} != manifest {rec.digest}")
    if deep and not report.problems and manifest.layout == LAYOUT_DCP:  # else: no segments
        from replication.durable.loader import read_segments

        for r in sorted(wanted):
            try:
                read_segments(info, r, None, verify=False, storage_options=opts)
            except (DurableError, OSError) as exc:
                report.problems.append(f"rank {r}: {exc}")
    report.ok = not report.problems
    report.duration_s = time.monotonic() - t0
    if report.ok:
        log.info("verified %s: %d files, %.1f MB in %.2fs", info.url, report.files_checked,
                 report.nbytes / 1e6, report.duration_s)
    else:
        log.warning("checkpoint %s is corrupted: %s", info.url, "; ".join(report.problems))
    return report


def ensure_intact(info: CheckpointInfo, ranks: list[int], storage_options: dict | None) -> None:
    """Raise :class:`CorruptCheckpoint` unless ``ranks``' files match the manifest."""
    report = verify(info, storage_options, ranks=ranks)
    if not report.ok:
        raise CorruptCheckpoint(
            f"checkpoint {info.url} is corrupted: {'; '.join(report.problems)}"
        )


@dataclass
class PruneReport:
    kept: list[int] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    spared: list[str] = field(default_factory=list)  # incomplete but maybe in progress

    def to_json(self) -> dict[str, Any]:
        return {"kept": self.kept, "deleted": self.deleted, "spared": self.spared}


def prune(
    url: str,
    keep_last: int,
    storage_options: dict | None = None,
    *,
    incomplete_grace_s: float | None = 3600.0,
    dry_run: bool = False,
) -> PruneReport:
    """Keep the newest ``keep_last`` valid checkpoints; delete older ones and leftovers.

    Incomplete or damaged directories older than the newest valid checkpoint are
    deleted (no save can still be writing them: every rank writes steps in order, and
    the newer checkpoint needed all of them). Newer ones may be a save in progress:
    they are deleted only when untouched for ``incomplete_grace_s`` (``None``: never).
    A valid checkpoint loses its manifest first, so a prune killed midway leaves an
    incomplete directory, never a listed checkpoint with missing files.
    """
    if keep_last < 0:
        raise ValueError(f"keep_last must be >= 0, got {keep_last}")
    fs, root = resolve(url, storage_options)
    try:
        infos = [inspect_step(fs, root, s, url, storage_options) for s in step_dirs(fs, root)]
    except FileNotFoundError:
        raise DurableError(f"{url} does not exist") from None
    return prune_infos(fs, root, infos, keep_last, incomplete_grace_s, dry_run)


def prune_infos(
    fs: fsspec.AbstractFileSystem,
    root: str,
    infos: list[CheckpointInfo],
    keep_last: int,
    incomplete_grace_s: float | None,
    dry_run: bool,
) -> PruneReport:
    report = PruneReport()
    valid = [i for i in infos if i.valid]
    keep = valid[max(0, len(valid) - keep_last):] if keep_last else []
    report.kept = [i.step for i in keep]
    kept = set(report.kept)
    newest = valid[-1].step if valid else -1
    now = time.time()
    for info in infos:
        if info.step in kept:
            continue
        sdir = step_dir(root, info.step)
        if not info.valid and info.step > newest:
            fresh = incomplete_grace_s is None or (
                info.mtime and now - info.mtime < incomplete_grace_s
            )
            if fresh:
                report.spared.append(info.url)
                continue
        report.deleted.append(info.url)
        if dry_run:
            continue
        if info.valid:
            rm_quiet(fs, posixpath.join(sdir, MANIFEST))
        rm_quiet(fs, sdir, recursive=True)
        log.info("pruned %s checkpoint %s", info.status, info.url)
    return report


__all__ = [
    "CheckpointInfo",
    "CorruptCheckpoint",
    "PruneReport",
    "VerifyReport",
    "latest_checkpoint",
    "list_checkpoints",
    "open_checkpoint",
    "prune",
    "scan",
    "verify",
]
