"""Atomic, verified cache files shared by the node cache and the epoch cache.

Why a temp file plus ``os.replace``: a worker can be SIGKILLed halfway through a write,
and a reader in another process (the replacement worker) must then see either the old
complete entry or none, never a torn one. The rename is atomic within one filesystem.
The checksum in every frame catches what the rename cannot (a bit flip, a file truncated
by hand, a disk error); a bad entry is deleted and reported so the caller recomputes it.

Temp files carry the writer's pid in their name, so the leftovers of a killed writer can
be recognised and removed by whoever comes next.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from .codec import CorruptEntryError, Frame, decode

TMP_PREFIX = ".tmp-"


def tmp_name(directory: str) -> str:
    """A unique temp path in ``directory``; the pid makes dead writers' files recognisable."""
    return os.path.join(
        directory, f"{TMP_PREFIX}{os.getpid()}-{threading.get_ident()}-{uuid.uuid4().hex[:12]}"
    )


def atomic_write(path: str, frame: Frame | bytes | bytearray) -> int:
    """Write ``frame`` to ``path`` atomically (temp file, then rename). Returns bytes written."""
    tmp = tmp_name(os.path.dirname(path))
    try:
        with open(tmp, "wb") as f:
            if isinstance(frame, Frame):
                frame.write(f)
                n = frame.nbytes
            else:
                f.write(frame)
                n = len(frame)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return n


def read_frame(path: str) -> bytearray | None:
    """Read a whole file into a fresh ``bytearray``; ``None`` if it does not exist."""
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            buf = bytearray(size)
            got = f.readinto(buf)
    except FileNotFoundError:
        return None
    if got != size:  # shrank under us: treat like a torn file
        del buf[got:]
    return buf


def read_verified(path: str) -> tuple[Any, int] | None:
    """Read and decode an entry. ``None`` if absent; :class:`CorruptEntryError` if bad.

    The caller decides what to do with a corrupt entry (delete, count, recompute); this
    function never returns unverified data.
    """
    buf = read_frame(path)
    if buf is None:
        return None
    return decode(buf), len(buf)


def remove_quietly(path: str) -> bool:
    """Unlink ``path``; ``False`` if it was already gone (another process won the race)."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_orphan_tmp(name: str, mtime: float, max_age_s: float = 3600.0) -> bool:
    """True for a temp file whose writer is dead (or that is implausibly old)."""
    if not name.startswith(TMP_PREFIX):
        return False
    try:
        pid = int(name[len(TMP_PREFIX) :].split("-", 1)[0])
    except ValueError:
        return True
    return not pid_alive(pid) or (time.time() - mtime) > max_age_s


@contextlib.contextmanager
def file_lock(path: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``path``, shared by every process on the node.

    The kernel drops the lock when its holder dies, so a SIGKILLed worker can never
    leave the cache locked.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the flock


__all__ = [
    "CorruptEntryError",
    "atomic_write",
    "file_lock",
    "is_orphan_tmp",
    "pid_alive",
    "read_frame",
    "read_verified",
    "remove_quietly",
    "tmp_name",
]
