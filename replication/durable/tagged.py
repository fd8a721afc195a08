"""Checkpoints in a framework's own layout, named by a tag, committed like the runtime's.

DeepSpeed writes ``<save_dir>/<tag>/`` (``mp_rank_00_model_states.pt`` and one
``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per rank) and a ``<save_dir>/latest``
file naming the newest tag, which ``engine.load_checkpoint(save_dir)`` follows. Written
that way, a reader can find a tag whose files are half there: DeepSpeed writes
``latest`` the moment its own ranks return from ``torch.save``. This module commits such
a directory the way the runtime commits its step directories (ADR 0052)::

    <save_dir>/<tag>.partial-<attempt>/<file>            each file written whole (tmp + rename)
    <save_dir>/<tag>.partial-<attempt>/rank_<r>.done.json   rank r is done: sizes, checksums
    <save_dir>/<tag>.partial-<attempt>/MANIFEST.json     rank 0, once every rank is done
    <save_dir>/<tag>                                     the directory renamed: it exists
    <save_dir>/latest                                    then names it (tmp + rename)

so a reader that follows ``latest`` never finds a partial checkpoint, and a save cut
short by a failure leaves only a ``.partial-`` directory, which ``checkpointless ckpt
list --all`` shows as incomplete and the next commit of the same tag removes. The
attempt names the runtime generation and the save's number within it: a replay after a
recovery writes a new attempt, never into files that a dead rank left half written.

Local and shared file systems only: DeepSpeed's layout is a file system's (it copies its
``zero_to_fp32.py`` next to the tags with ``shutil``).
"""

from __future__ import annotations

import logging
import os
import posixpath
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import fsspec
import xxhash

from replication.durable.catalog import INCOMPLETE, CheckpointInfo, inspect_dir
from replication.durable.format import (
    MANIFEST,
    CorruptCheckpoint,
    DurableError,
    FileRecord,
    Manifest,
    RankRecord,
    done_name,
    dumps,
    loads,
    parse_step,
)
from replication.durable.storage import display_url, fsync_dir, resolve, write_atomic

log = logging.getLogger("checkpointless.durable")

PARTIAL = ".partial-"
FAILED = ".failed.txt"  # a rank that could not write its part says why
LATEST = "latest"  # DeepSpeed's name for the file that names the newest tag


def local_dir(save_dir: str) -> str:
    """``save_dir`` as an absolute local path, or one line saying why it cannot be."""
    fs, path = resolve(save_dir)
    if not isinstance(fs, fsspec.implementations.local.LocalFileSystem):
        raise DurableError(
            f"{save_dir}: a DeepSpeed checkpoint is a file system's layout (DeepSpeed "
            "itself writes next to it with plain file calls): give a local or shared "
            "file-system path")
    return os.path.abspath(path)


@dataclass
class TaggedSave:
    """One rank's part of one save of ``<save_dir>/<tag>``, and (rank 0) its commit."""

    save_dir: str
    tag: str
    attempt: str  # the same on every rank, new for every try (see the module docstring)
    rank: int
    world_size: int
    step: int
    run_id: str
    layout: str
    files: dict[str, FileRecord] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.fs = fsspec.filesystem("file")
        self.not_committed = ""  # why :meth:`commit` gave the save up

    @property
    def final(self) -> str:
        return posixpath.join(self.save_dir, self.tag)

    @property
    def staging(self) -> str:
        return posixpath.join(self.save_dir, f"{self.tag}{PARTIAL}{self.attempt}")

    def staged(self, path: str) -> str | None:
        """Where a file DeepSpeed names under the final directory is written, relative to
        the staging directory (``None``: the path is not under it)."""
        rel = posixpath.relpath(os.path.abspath(path), self.final)
        return None if rel.startswith("..") or rel == "." else rel

    def write(self, rel: str, data: bytes | memoryview) -> FileRecord:
        path = posixpath.join(self.staging, rel)
        os.makedirs(posixpath.dirname(path), exist_ok=True)
        rec = write_atomic(self.fs, path, data)  # type: ignore[arg-type]  # a buffer: no copy
        self.files[rel] = FileRecord(rel, rec.size, rec.digest)
        return self.files[rel]

    def finish_rank(self) -> None:
        """This rank's files are all written: say so, with their sizes and checksums."""
        os.makedirs(self.staging, exist_ok=True)
        rec = RankRecord(self.rank, self.world_size, self.step, self.run_id, dict(self.files),
                         {}, sum(f.size for f in self.files.values()), time.time())
        write_atomic(self.fs, posixpath.join(self.staging, done_name(self.rank)),
                     dumps(rec.to_json()))

    def give_up(self, why: str) -> None:
        """This rank could not write its part: rank 0 stops waiting for it at once."""
        os.makedirs(self.staging, exist_ok=True)
        with open(posixpath.join(self.staging, f"rank_{self.rank}{FAILED}"), "w") as f:
            f.write(why)

    def commit(self, *, point_latest: bool, abandoned: Callable[[], str | None],
               timeout_s: float, poll_s: float = 0.05) -> Manifest | None:
        """Rank 0: once every rank is done, write the manifest, put the directory in place
        and point ``latest`` at it. ``None`` when ``abandoned()`` gives a reason first (a
        failure: the replay saves again) or ``timeout_s`` passes; the staging directory
        then stays, incomplete."""
        deadline = time.monotonic() + timeout_s
        while (records := self._records()) is None:
            why = self._given_up() or abandoned() or (
                "" if time.monotonic() < deadline
                else f"not every rank finished writing within {timeout_s:.0f}s")
            if why:
                log.warning("checkpointless: %s checkpoint %s not committed: %s",
                            self.layout, self.final, why)
                self.not_committed = why
                return None
            time.sleep(poll_s)
        manifest = Manifest(self.step, self.world_size, self.run_id,
                            max(r.finished_unix for r in records), tuple(records),
                            layout=self.layout, tag=self.tag)
        write_atomic(self.fs, posixpath.join(self.staging, MANIFEST), dumps(manifest.to_json()))
        self._put_in_place()
        if point_latest:
            write_atomic(self.fs, posixpath.join(self.save_dir, LATEST), self.tag.encode())
        self._remove_stale_attempts()
        return manifest

    def _records(self) -> list[RankRecord] | None:
        records = []
        for r in range(self.world_size):
            path = posixpath.join(self.staging, done_name(r))
            try:
                with open(path, "rb") as f:
                    rec = RankRecord.from_json(loads(f.read(), path), path)
            except FileNotFoundError:
                return None
            if (rec.step, rec.world_size, rec.run_id) != (self.step, self.world_size,
                                                           self.run_id):
                raise CorruptCheckpoint(f"{path} is for step {rec.step} of a world of "
                                        f"{rec.world_size} (run {rec.run_id!r})")
            records.append(rec)
        return records

    def _given_up(self) -> str | None:
        for name in sorted(os.listdir(self.staging)) if os.path.isdir(self.staging) else ():
            if name.endswith(FAILED):
                with open(posixpath.join(self.staging, name)) as f:
                    return f"{name.removesuffix(FAILED).replace('_', ' ')}: {f.read()}"
        return None

    def _put_in_place(self) -> None:
        if os.path.isdir(self.final) and not os.path.exists(
                posixpath.join(self.final, MANIFEST)):
            # The script wrote files of its own into the tag (HF-style extras): keep them,
            # and move this save's files in beside them, the manifest last.
            names = sorted(os.listdir(self.staging), key=lambda n: n == MANIFEST)
            for name in names:
                os.replace(posixpath.join(self.staging, name), posixpath.join(self.final, name))
            fsync_dir(self.fs, self.final)
            os.rmdir(self.staging)
            return
        old = None
        if os.path.exists(self.final):  # the same tag saved again: the newer one replaces it
            old = f"{self.final}.replaced-{self.attempt}"
            os.rename(self.final, old)
        os.rename(self.staging, self.final)
        fsync_dir(self.fs, self.save_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def _remove_stale_attempts(self) -> None:
        """Attempts of this tag that a failure cut short: every rank has since finished a
        newer one, so nothing writes into them any more."""
        prefix = f"{self.tag}{PARTIAL}"
        for name in os.listdir(self.save_dir):
            if name.startswith(prefix) and name != posixpath.basename(self.staging):
                shutil.rmtree(posixpath.join(self.save_dir, name), ignore_errors=True)


def read_verified(path: str) -> bytes:
    """The bytes of one file of a tagged checkpoint, checked against its manifest (a file
    with no manifest beside it, as plain DeepSpeed writes them, is read as it is)."""
    with open(path, "rb") as f:
        data = f.read()
    tag_dir = os.path.dirname(os.path.abspath(path))
    where = posixpath.join(tag_dir, MANIFEST)
    try:
        with open(where, "rb") as f:
            manifest = Manifest.from_json(loads(f.read(), where), where)
    except FileNotFoundError:
        return data
    rec = manifest.files.get(os.path.basename(path))
    if rec is None:
        raise CorruptCheckpoint(f"{path} is not in its checkpoint's manifest")
    got = xxhash.xxh3_128_hexdigest(data)
    if (len(data), got) != (rec.size, rec.digest):
        raise CorruptCheckpoint(
            f"{path}: {len(data)} bytes with checksum {got}, the manifest says {rec.size} "
            f"bytes with {rec.digest}: the checkpoint is damaged (`checkpointless ckpt "
            "verify` lists every damaged file)")
    return data


def scan_tagged(url: str, storage_options: dict | None = None) -> list[CheckpointInfo]:
    """The tagged checkpoints directly under ``url`` (each directory with a manifest) and
    the attempts not committed (incomplete), by step; [] when there are none."""
    fs, root = resolve(url, storage_options)
    try:
        entries = fs.ls(root, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return []
    infos = []
    for e in entries:
        if e.get("type") != "directory":
            continue
        path = e["name"].rstrip("/")
        if parse_step(path) is not None:  # the runtime's own step directories: not tags
            continue
        if PARTIAL in posixpath.basename(path):
            infos.append(_unfinished(fs, path, url, storage_options))
        elif fs.exists(posixpath.join(path, MANIFEST)):
            infos.append(inspect_dir(fs, path, None, url, storage_options))
    return sorted(infos, key=lambda i: (i.step, i.url))


def _unfinished(fs: fsspec.AbstractFileSystem, path: str, url: str,
                storage_options: dict | None) -> CheckpointInfo:
    step, found = -1, fs.find(path, detail=True)
    for p in found:
        if p.endswith(".done.json"):
            try:
                step = int(loads(fs.cat_file(p), p)["step"])
            except (CorruptCheckpoint, KeyError, TypeError, ValueError, OSError):
                continue
            break
    mtime = max((float(i.get("mtime") or 0) for i in found.values()), default=0.0)
    return CheckpointInfo(url=display_url(fs, path), root=url, step=step, status=INCOMPLETE,
                          reason="a save not committed (in progress, or cut short)",
                          nbytes=sum(int(i.get("size") or 0) for i in found.values()),
                          mtime=mtime, storage_options=dict(storage_options or {}))
