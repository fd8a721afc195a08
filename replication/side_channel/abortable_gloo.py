"""A gloo process group that can be aborted, and then really freed.

Gloo has no working abort: ``ProcessGroupGloo.abort()`` and ``shutdown()`` return at
once but release no pending operation, and destroying a group whose operation waits on
a silent peer joins its worker threads (with the GIL held) until the operation's own
timeout. Measured on torch 2.13 (``docs/adr/0015-owned-process-group.md``): shutting
down the group's *connected* TCP sockets makes every pending operation on them fail
within a millisecond ("Connection closed by peer"), on this rank and on the peers at
the other end; after that the group destroys in milliseconds and its threads are gone.

So a group is created while we watch which sockets it opens (a process-wide lock
serialises group creation, so the sockets that appear are its own), and ``abort``
shuts those down. The listening socket is never touched: gloo's accept loop treats an
error there as fatal and aborts the process. Each socket is shut down through a
duplicate descriptor, after checking that the duplicate names the socket recorded
(same inode): gloo may close its descriptor at any moment, and the number be reused.
Gloo's own descriptor is never closed here (it closes it when the group is destroyed).
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from replication.side_channel.interruptible_store import InterruptibleStore

_create_lock = threading.Lock()
_FD_DIR = "/proc/self/fd"


def _socket_fds() -> dict[int, str]:
    """Open socket descriptors of this process: fd -> ``socket:[inode]``."""
    found: dict[int, str] = {}
    try:
        names = os.listdir(_FD_DIR)
    except OSError:  # no procfs: abort degrades to "wait for the timeout"
        return found
    for name in names:
        try:
            link = os.readlink(f"{_FD_DIR}/{name}")
        except OSError:
            continue
        if link.startswith("socket:"):
            found[int(name)] = link
    return found


def _is_connected_tcp(fd: int) -> bool:
    try:
        sock = socket.socket(fileno=fd)
    except OSError:  # closed meanwhile
        return False
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET,
                                                                  socket.AF_INET6):
            return False
        return not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    except OSError:
        return False
    finally:
        sock.detach()  # gloo owns the descriptor: never close it here


class AbortableGloo:
    """A ``ProcessGroupGloo`` plus the connected sockets it opened.

    ``backend`` is the gloo group (a ``torch.distributed`` Backend). ``abort()`` makes
    every operation pending on it fail now, here and at the peers; ``release()`` drops
    this object's reference once nothing is pending, so the group's threads and
    sockets really go away.
    """

    def __init__(self, backend: Any, sockets: dict[int, str]) -> None:
        self.backend: Any = backend
        self.sockets = sockets
        self.aborted = False

    @classmethod
    def create(
        cls, store: dist.Store, rank: int, size: int, timeout_s: float,
        hostname: str | None = None, interrupted: Callable[[], str | None] | None = None,
    ) -> AbortableGloo:
        """Connect a gloo group of ``size`` ranks over ``store`` (a collective call);
        ``hostname`` pins the interface it listens on (``--bind``).

        ``interrupted()``: a reason to stop waiting for a peer that may never come (a
        newer generation was declared); the connection then ends at once with
        :class:`~replication.side_channel.interruptible_store.StoreWaitInterrupted` instead of
        waiting out ``timeout_s`` (:mod:`replication.side_channel.interruptible_store`)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if interrupted is not None:
            store = InterruptibleStore(store, interrupted, timeout_s)
        with _create_lock:
            before = _socket_fds()
            if hostname:
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = timeout
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
                backend = dist.ProcessGroupGloo(store, rank, size, opts)
            else:
                backend = dist.ProcessGroupGloo(store, rank, size, timeout)
            after = _socket_fds()
        mine = {fd: link for fd, link in after.items()
                if before.get(fd) != link and _is_connected_tcp(fd)}
        return cls(backend, mine)

    def abort(self) -> int:
        """Shut down the group's connections; returns how many were shut down.

        Idempotent. Pending operations fail at once with gloo's "Connection closed"
        error, on this rank and on each peer at the other end of a socket.
        """
        self.aborted = True
        done = 0
        for fd, link in self.sockets.items():
            # Work on a duplicate: gloo may close ``fd`` at any moment (its peer went
            # away), and the number may then be reused. The duplicate pins whatever
            # ``fd`` named when it was taken; it is ours only if that is still our socket.
            try:
                dup = os.dup(fd)
            except OSError:
                continue  # closed already
            try:
                if os.readlink(f"{_FD_DIR}/{dup}") != link:
                    continue  # gloo closed it and the number was reused: not ours
                with socket.socket(fileno=dup) as sock:  # closing it closes the duplicate
                    dup = -1
                    try:
                        sock.shutdown(socket.SHUT_RDWR)  # acts on the socket, not the fd
                        done += 1
                    except OSError:
                        pass  # already closed by the peer: nothing pending on it
            except OSError:
                continue
            finally:
                if dup >= 0:
                    os.close(dup)
        return done

    def release(self) -> None:
        """Drop this object's reference to the group, once nothing is pending on it
        (the caller checks; after :meth:`abort` pending works end within milliseconds).
        Destroying a group with a blocked operation would join its worker thread with
        the GIL held, so a caller that cannot tell keeps it (``process_groups.keep``)."""
        self.backend = None
        self.sockets = {}
