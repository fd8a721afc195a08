"""Worker output on the agent's console, one whole line at a time, prefixed with the rank.

With many ranks on a node, bare worker output cannot be told apart ("durable checkpoint
skipped" eight times, tracebacks of unknown origin) and long lines from two workers can
interleave mid-line. So each worker's stdout and stderr are pipes that the agent copies
to its own stdout and stderr, prefixing every line with ``[rank<N>]: `` (torchrun's
``--tee`` style; a line that already starts with it, as torch's own C++ logging
writes them, is not prefixed twice) and writing each line with one call under a lock.

A warm spare's pipes exist before it has a rank: its lines read ``[spare]: `` until
:meth:`Relay.set_label` names the rank it was handed. Relays are daemon threads; the
agent calls :func:`drain` before it exits so a worker's last lines are not lost (bounded:
a grandchild that inherited the pipe may keep it open).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from typing import BinaryIO, TextIO

_LOCK = threading.Lock()
#: Rank prefixes at the start of a line, however many (see :meth:`Relay._write`).
_RANK_PREFIXES = re.compile(rb"^(?:\[rank\d+\]: ?)+")
_THREADS: list[threading.Thread] = []
_BY_PID: dict[int, Relay] = {}
MAX_PENDING = 16 * 1024  # a "line" this long without a newline is written out anyway


class Relay:
    """Copies one child's stdout and stderr to ours with a prefix that can change."""

    def __init__(self, proc: subprocess.Popen, label: str) -> None:
        self.label = label
        self._threads: list[threading.Thread] = []
        for src, dst in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            if src is None:
                continue
            t = threading.Thread(target=self._copy, args=(src, dst), daemon=True,
                                 name=f"checkpointless-output-{proc.pid}")
            t.start()
            self._threads.append(t)
            _THREADS.append(t)

    @property
    def alive(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def set_label(self, label: str) -> None:
        self.label = label

    def _copy(self, src: BinaryIO, dst: TextIO) -> None:
        fd, pending = src.fileno(), b""
        try:
            while True:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self._write(dst, line + b"\n")
                if len(pending) > MAX_PENDING:
                    self._write(dst, pending + b"\n")
                    pending = b""
        except OSError:
            pass
        finally:
            if pending:
                self._write(dst, pending + b"\n")
            src.close()

    def _write(self, dst: TextIO, line: bytes) -> None:
        # torch's C++ logging starts lines with "[rank3]:", and an error that quotes
        # another (a failure reported through a collective) nests them, up to 12 deep
        # in practice: every leading rank prefix goes, and this process's label
        # (the rank it runs now) is written once.
        data = f"[{self.label}]: ".encode() + _RANK_PREFIXES.sub(b"", line, count=1)
        with _LOCK:
            try:
                dst.flush()  # whatever the agent printed itself goes first
                dst.buffer.write(data)
                dst.buffer.flush()
            except (OSError, ValueError, AttributeError):
                pass  # our console is gone; the worker must not notice


def say(text: str, dst: TextIO | None = None) -> None:
    """Write one whole line of the agent's own to ``dst`` (stderr by default), with one
    call under the relays' lock. A ``print`` makes two writes (the text, then the
    newline) into the text layer, and a relay thread flushing that layer in between
    (see :meth:`Relay._write`) once left the agent's "listening on ..." line without its
    newline, so the next line (its SIGINT notice) ran on after it."""
    dst = dst if dst is not None else sys.stderr
    with _LOCK:
        try:
            dst.flush()
            dst.buffer.write((text + "\n").encode())
            dst.buffer.flush()
        except (OSError, ValueError, AttributeError):
            try:  # a stream without a byte layer (a test's StringIO)
                dst.write(text + "\n")
                dst.flush()
            except (OSError, ValueError):
                pass  # our console is gone


def relay(proc: subprocess.Popen, label: str) -> Relay:
    """Start copying ``proc``'s piped output, prefixed with ``label``."""
    r = _BY_PID[proc.pid] = Relay(proc, label)
    return r


def relabel(pid: int, label: str) -> None:
    """Name the rank a warm spare was just handed."""
    r = _BY_PID.get(pid)
    if r is not None:
        r.set_label(label)


def drain(timeout_s: float = 2.0) -> None:
    """Wait (bounded) until the output of exited workers has been written."""
    deadline = time.monotonic() + timeout_s
    for t in list(_THREADS):
        t.join(max(0.0, deadline - time.monotonic()))
    _THREADS[:] = [t for t in _THREADS if t.is_alive()]
    for pid in [pid for pid, r in _BY_PID.items() if not r.alive]:
        del _BY_PID[pid]
