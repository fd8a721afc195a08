"""DCP's storage classes on any fsspec filesystem (imported only where DCP is used).

``torch.distributed.checkpoint`` costs about two seconds to import on a small host, so
listing or verifying checkpoints (the CLI) never imports it. The writer's helper process
imports it before it reports ready; a writer that saves from a thread imports it when it
is constructed, never on its background thread in the middle of training.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import fsspec
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

from replication.durable.format import CorruptCheckpoint
from replication.durable.storage import (
    DirectFile,
    HashingStream,
    Progress,
    direct_io_ok,
    is_posix,
    rm_quiet,
)

try:  # torch >= 2.15: the public module (the private one is a deprecated shim of it)
    from torch.distributed.checkpoint.fsspec_filesystem import (
        _FileSystem as _DcpFsspecFileSystem,
    )
except ImportError:  # torch 2.11-2.14
    from torch.distributed.checkpoint._fsspec_filesystem import (
        FileSystem as _DcpFsspecFileSystem,
    )

__all__ = [
    "CheckpointException", "RankReader", "RankWriter", "StagedSavePlanner",
    "TensorOnlyLoadPlanner", "TrackedFS", "Tracker",
]


class Tracker:
    """Records size and checksum of every file written through :class:`TrackedFS`."""

    def __init__(self, progress: Progress | None = None) -> None:
        self.files: dict[str, tuple[int, str]] = {}
        self.progress = progress
        self._lock = threading.Lock()

    def record(self, path: str, size: int, digest: str) -> None:
        with self._lock:
            self.files[path] = (size, digest)

    def renamed(self, old: str, new: str) -> None:
        with self._lock:
            if old in self.files:
                self.files[new] = self.files.pop(old)

    def removed(self, path: str) -> None:
        with self._lock:
            self.files.pop(path, None)


class TrackedFS(_DcpFsspecFileSystem):
    """DCP's fsspec ``FileSystem`` bound to a given fs, hashing every file it writes.

    Checksums are computed as the bytes stream out, so the manifest costs no second
    pass over the data (and, on object stores, no download).
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, tracker: Tracker | None) -> None:
        super().__init__()
        self.fs = fs
        self.tracker = tracker

    def init_path(self, path: str | os.PathLike, **kwargs: Any) -> str | os.PathLike:
        return path

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        path = os.fspath(path)
        if not any(ch in mode for ch in "wa+"):
            with self.fs.open(path, mode) as stream:
                yield stream
            return
        stream = None
        try:
            opener = DirectFile if direct_io_ok(self.fs) else lambda p: self.fs.open(p, "wb")
            with opener(path) as raw:
                stream = HashingStream(raw, self.tracker.progress if self.tracker else None)
                yield stream
                stream.close()
        except BaseException:
            rm_quiet(self.fs, path)
            raise
        if self.tracker is not None and stream is not None:
            self.tracker.record(path, stream.size, stream.hasher.hexdigest())

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        self.fs.mv(os.fspath(path), os.fspath(new_path))
        if self.tracker is not None:
            self.tracker.renamed(os.fspath(path), os.fspath(new_path))

    def rm_file(self, path: str | os.PathLike) -> None:
        self.fs.rm(os.fspath(path))
        if self.tracker is not None:
            self.tracker.removed(os.fspath(path))


class RankWriter(FileSystemWriter):
    """DCP's filesystem writer on an arbitrary fsspec fs, with checksums on the fly.

    One file per rank (``single_file_per_rank``), one thread (the durable writer's own),
    fsync on POSIX stores only: on object stores DCP would fall back to a global
    ``os.sync()``, and a completed PUT is already durable.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, tracker: Tracker) -> None:
        super().__init__(
            path, single_file_per_rank=True, sync_files=is_posix(fs), thread_count=1,
            overwrite=True,
        )
        self.fs = TrackedFS(fs, tracker)
        self.path = path


class RankReader(FileSystemReader):
    """DCP's filesystem reader on an fsspec fs; reads ``.metadata`` with an allow-list."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, metadata: Any) -> None:
        super().__init__(path)
        self.fs = TrackedFS(fs, None)
        self.path = path
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        md = self._metadata
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, minus unpickling: our checkpoints hold tensors only."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise CorruptCheckpoint(
            f"checkpoint holds a pickled object at {read_item.dest_index.fqn!r}; refusing it"
        )


class StagedSavePlanner(DefaultSavePlanner):
    """DCP's default save planner that waits, before serialising each tensor, until the
    staging buffer holds that tensor's final bytes (``wait(end_offset)``)."""

    def __init__(self, wait: Any, ends: dict[str, int]) -> None:
        super().__init__()
        self._wait, self._ends = wait, ends

    def resolve_data(self, write_item: Any) -> Any:
        if self._wait is not None:
            end = self._ends.get(write_item.index.fqn)
            if end is not None:
                self._wait(end)
        return super().resolve_data(write_item)
