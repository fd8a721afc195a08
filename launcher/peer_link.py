"""A node whose agent died is seen in seconds: the kernel closes its sockets.

A heartbeat that stops is a timeout, and a timeout cannot be short on a loaded host: a
starved agent (an overloaded machine, a long pause) misses beats and comes back. But a
*dead* agent (SIGKILLed with its node's workers, its process crashed, its machine's
kernel still up) leaves evidence at once: every TCP connection it held is closed by its
kernel. So each agent listens on a socket of its own (:class:`LinkListener`, published
in its membership record) and each watcher holds one connection to every node it
watches (:class:`PeerLinks`), reading nothing but the end of the stream. When that
connection ends (end of stream, a reset, or a refused reconnection), the watcher notes
the time; :class:`launcher.liveness.PeerWatch` declares the node lost once its heartbeat
has not grown for a short confirmation since (two heartbeat intervals), unless the
agent said it finished. A stopped or starved process closes nothing (its kernel keeps
the socket open), so it is never a loss by this path: the heartbeat timeout judges it as
before.

A machine cut off from the network, or powered off, closes nothing either, but its
kernel stops answering. Every held connection has TCP keepalive on, at a short period:
a peer's kernel answers the probes whatever its agent does (stopped, starved, busy),
and a silent one fails the connection after about
``KEEPALIVE_IDLE_S + KEEPALIVE_COUNT * KEEPALIVE_INTERVAL_S`` (4 s), which ends the link
as above; with its heartbeat silent too, the node is lost about 6 s after the cut,
whatever the heartbeat timeout.

Nothing is read from a connection or trusted from it: its end is the only signal, and a
stranger can neither open nor close a watcher's connection to the genuine peer, whose
address comes from its sealed membership record.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time

CONNECT_TIMEOUT_S = 2.0
#: TCP keepalive on held connections: probes after 1 s of quiet, every 1 s, 3 unanswered
#: end the connection (answered by the peer's kernel, not its agent: see the module).
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 1, 1, 3
#: Connections a listener holds at most (a watcher holds one; a stranger opening many
#: only pushes the oldest out, which its watcher sees end and then reconnects).
MAX_HELD = 64


class LinkListener:
    """Accepts watchers' connections and holds them open for this process's life."""

    def __init__(self, host: str | None) -> None:
        family = socket.AF_INET6 if host and ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.bind((host or "", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._held: list[socket.socket] = []
        threading.Thread(target=self._accept, name="checkpointless-link-listener",
                         daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._held.append(conn)  # never read: its end is the only message
            if len(self._held) > MAX_HELD:
                self._held.pop(0).close()


class PeerLinks:
    """This agent's connections to the nodes it watches; when each one ended."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._closed: dict[int, float] = {}
        self._conns: dict[int, socket.socket] = {}
        self._epoch: dict[int, int] = {}  # node -> the connection attempt that counts
        self._attempts = itertools.count(1)

    def watch(self, addresses: dict[int, str]) -> None:
        """Hold a connection to each node of ``addresses`` (``host:port``), and none to
        any other; a node watched again gets a new connection."""
        with self._lock:
            for n in [n for n in self._epoch if n not in addresses]:
                self._drop(n)
            for n, address in addresses.items():
                if n not in self._epoch:
                    self._epoch[n] = next(self._attempts)
                    threading.Thread(target=self._hold, args=(n, address, self._epoch[n]),
                                     name=f"checkpointless-link-{n}", daemon=True).start()

    def reconnect(self, node: int) -> None:
        """Forget ``node``'s ended connection (its peer is alive: it beat since); the next
        :meth:`watch` opens a new one."""
        with self._lock:
            self._drop(node)

    def closed_at(self, node: int) -> float | None:
        """When the connection to ``node`` ended (monotonic), or None while it holds."""
        with self._lock:
            return self._closed.get(node)

    def _drop(self, n: int) -> None:
        self._epoch.pop(n, None)
        self._closed.pop(n, None)
        conn = self._conns.pop(n, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def _hold(self, n: int, address: str, epoch: int) -> None:
        host, _, port = address.rpartition(":")
        try:
            conn = socket.create_connection((host.strip("[]"), int(port)), CONNECT_TIMEOUT_S)
        except ConnectionRefusedError:  # nothing listens there: the process is gone
            self._ended(n, epoch, None)
            return
        except OSError:  # unreachable or slow: no evidence either way (the timeout decides)
            with self._lock:
                if self._epoch.get(n) == epoch:
                    self._epoch.pop(n)  # the next watch() tries again
            return
        conn.settimeout(None)
        _keepalive(conn)
        with self._lock:
            if self._epoch.get(n) != epoch:
                conn.close()
                return
            self._conns[n] = conn
        try:
            while conn.recv(64):
                pass
        except OSError:
            pass
        self._ended(n, epoch, conn)

    def _ended(self, n: int, epoch: int, conn: socket.socket | None) -> None:
        with self._lock:
            if self._epoch.get(n) == epoch:
                self._closed.setdefault(n, time.monotonic())
                if conn is not None and self._conns.get(n) is conn:
                    del self._conns[n]


def _keepalive(conn: socket.socket) -> None:
    """Short-period TCP keepalive (where the platform has the options; Linux does)."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
                        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
        if hasattr(socket, name):
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
