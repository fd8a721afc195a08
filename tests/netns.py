"""Real network hosts for tests: one Linux network namespace per node, one switch.

A multi-node job on one machine normally talks over loopback, where a lost node can
only be emulated by killing its processes, and a killed process's kernel answers for
it (FIN or RST): the survivors learn at once. A real partition says nothing at all.
:class:`NetLab` gives each node its own network stack so that its link can be cut
while its processes keep running.

Layout (``p`` = this process's pid, so parallel or crashed runs never collide)::

    clnet-p-sw   the switch namespace: bridge ``br0``, one port ``pN`` per node
    clnet-p-nN   node N: ``lo`` up, ``veth0`` = 10.213.0.(N+1)/24, MAC 02:13:00:00:00:NN

The subnet lives only inside these namespaces (the root namespace gets no interface,
route or address from us), so it cannot clash with the host's own networks, nor with
another run's (each run has its own switch). Every node gets permanent ARP entries for
the others: a cut link then shows up as silence (timeouts), never as the "no route to
host" error that failed ARP resolution would report after a few seconds.

:meth:`NetLab.cut` sets the node's switch port ``pN`` down: the bridge stops forwarding
to it, and the node's own ``veth0`` loses its carrier, so what it sends is dropped at
its own interface. Packets stop both ways, and since none reaches any peer's TCP stack,
no peer ever answers with RST or FIN: connections just go quiet, as when a cable is
pulled or a switch dies. The node's addresses and routes stay (a carrier loss keeps
them, unlike ``ip link set veth0 down`` inside the node, which would drop its subnet
route and fail its sends at once with ENETUNREACH). :meth:`NetLab.restore` sets the
port up again; TCP's retransmissions then deliver whatever was queued.

Cleanup: :meth:`NetLab.close` (the context manager, plus an ``atexit`` hook for an
interrupted run) deletes the namespaces, which destroys the veths and the bridge with
them; :func:`sweep` deletes namespaces of dead pids with our prefix, left by crashed
runs. Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN); :func:`available` says whether we
have it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

PREFIX = "clnet-"
SUBNET = "10.213.0"  # /24, private (RFC 1918), only ever inside our namespaces
NODE_IF = "veth0"
_NAME = re.compile(rf"^{PREFIX}(\d+)-")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=30)


def available() -> str | None:
    """None if namespaces can be made here, else why not (for a skip message)."""
    if shutil.which("ip") is None:
        return "iproute2 ('ip') is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"{PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"'ip netns add' is not permitted here: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep() -> list[str]:
    """Delete our namespaces whose creating process is gone; returns their names."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    gone = []
    for line in listed:
        name = line.split(" ", 1)[0]
        m = _NAME.match(name)
        if m and not _alive(int(m.group(1))):
            _ip("netns", "del", name, check=False)
            gone.append(name)
    return gone


def namespaces_of(pid: int) -> list[str]:
    """Our namespaces created by ``pid`` that still exist (a test checks none is left)."""
    names = [ln.split(" ", 1)[0] for ln in _ip("netns", "list", check=False).stdout.split("\n")]
    return [n for n in names if n.startswith(f"{PREFIX}{pid}-")]


@dataclass
class NetLab:
    """``nodes`` namespaces on one bridge; see the module docstring for the layout."""

    nodes: int
    tag: str = ""  # tells apart several labs of one process (their names include it)
    created: list[str] = field(default_factory=list)
    _closed: bool = False

    @property
    def base(self) -> str:
        return f"{PREFIX}{os.getpid()}-{self.tag}" if self.tag else f"{PREFIX}{os.getpid()}-"

    @property
    def switch(self) -> str:
        return f"{self.base}sw"

    def ns(self, node: int) -> str:
        return f"{self.base}n{node}"

    @staticmethod
    def addr(node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    @staticmethod
    def mac(node: int) -> str:
        return f"02:13:00:00:00:{node + 1:02x}"

    @staticmethod
    def port(node: int) -> str:
        return f"p{node}"

    def start(self) -> NetLab:
        sweep()
        atexit.register(self.close)
        try:
            self._add_ns(self.switch)
            self._in(self.switch, "ip", "link", "add", "br0", "type", "bridge")
            self._in(self.switch, "ip", "link", "set", "br0", "up")
            for n in range(self.nodes):
                self._add_node(n)
            for n in range(self.nodes):
                for peer in range(self.nodes):
                    if peer != n:
                        self._in(self.ns(n), "ip", "neigh", "replace", self.addr(peer),
                                 "lladdr", self.mac(peer), "dev", NODE_IF, "nud", "permanent")
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self.created.append(name)
        self._in(name, "ip", "link", "set", "lo", "up")

    def _add_node(self, n: int) -> None:
        ns = self.ns(n)
        self._add_ns(ns)
        # Both ends are created straight into their namespaces: no name in the root one.
        _ip("link", "add", NODE_IF, "netns", ns, "address", self.mac(n), "type", "veth",
            "peer", "name", self.port(n), "netns", self.switch)
        self._in(self.switch, "ip", "link", "set", self.port(n), "master", "br0")
        self._in(self.switch, "ip", "link", "set", self.port(n), "up")
        self._in(ns, "ip", "addr", "add", f"{self.addr(n)}/24", "dev", NODE_IF)
        self._in(ns, "ip", "link", "set", NODE_IF, "up")

    @staticmethod
    def _in(ns: str, *cmd: str) -> None:
        subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True,
                       check=True, timeout=30)

    def prefix(self, node: int) -> list[str]:
        """Put in front of a command (``Popen``) to run it inside ``node``'s namespace."""
        return ["ip", "netns", "exec", self.ns(node)]

    def run(self, node: int, cmd: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run([*self.prefix(node), *cmd], **kwargs)

    def cut(self, node: int) -> None:
        """Pull ``node``'s cable at the switch: silence both ways, no RST (see module)."""
        self._in(self.switch, "ip", "link", "set", self.port(node), "down")

    def restore(self, node: int) -> None:
        self._in(self.switch, "ip", "link", "set", self.port(node), "up")

    def close(self) -> None:
        """Delete every namespace (and so every veth and the bridge); idempotent.

        A process still running inside a namespace keeps its stack alive but nameless
        until it exits: callers kill their processes first.
        """
        if self._closed:
            return
        self._closed = True
        for name in reversed(self.created):
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                _ip("netns", "del", name, check=False)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)

    def __enter__(self) -> NetLab:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
