"""Where this node's listening sockets go (``checkpointless run --bind``).

A job listens in two places: the job store that node 0's agent hosts (a c10d TCPStore
server), and the gloo process groups of every worker (the training group and the
replication side channel; each gloo pair listens on its device's address). Neither has
authentication, so they should listen on the network the job uses and nowhere else.

- The TCPStore server of torch 2.13 has no bind-address option: it listens on every
  interface (``*:port``). It does accept an already bound listening socket
  (``master_listen_fd``), so :func:`listening_socket` binds one to the chosen address
  and the store takes it over.
- Gloo picks its address from ``GLOO_SOCKET_IFNAME`` (an interface name) or, without
  it, from what the host name resolves to. The agent sets ``GLOO_SOCKET_IFNAME`` to the
  interface that holds the chosen address, unless the user set it already.

The default (:func:`choose`): a job whose endpoint is a loopback address stays on
loopback; otherwise node 0 binds the endpoint's own address (it must be one of this
machine's, and not a loopback one its host name maps to here when other nodes will
join), and other nodes use the address their route to the endpoint leaves from.
``--bind ADDRESS`` picks the address; ``--bind all`` restores "every interface".
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

import psutil

from replication.errors import CheckpointlessError

#: ``--bind`` values that mean "every interface" (the c10d default).
ALL_INTERFACES = ("all", "*", "0.0.0.0", "::")


class BindError(CheckpointlessError, ValueError):
    """The requested or default bind address cannot be used on this machine."""


@dataclass(frozen=True)
class BindPlan:
    """What this node listens on."""

    address: str | None  # the store's (and gloo's) address; None: every interface
    gloo_ifname: str | None  # GLOO_SOCKET_IFNAME for the workers; None: gloo's default
    why: str  # how it was chosen, for the agent's log

    @property
    def describe(self) -> str:
        where = self.address or "every interface"
        gloo = f", gloo on {self.gloo_ifname}" if self.gloo_ifname else ""
        return f"{where}{gloo} ({self.why})"


def local_addresses() -> dict[str, str]:
    """Every IP address of this machine -> the interface that holds it."""
    out: dict[str, str] = {}
    for ifname, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                out.setdefault(a.address.split("%", 1)[0], ifname)
    return out


def resolve(host: str) -> list[str]:
    """The IP addresses ``host`` names (IPv4 first), [] if it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return []
    found = []
    for *_, sockaddr in sorted(infos, key=lambda i: i[0] != socket.AF_INET):
        if sockaddr[0] not in found:
            found.append(str(sockaddr[0]))
    return found


def is_loopback(host: str) -> bool:
    """Does ``host`` resolve to loopback addresses only (here; maybe not elsewhere)?"""
    addrs = resolve(host)
    return bool(addrs) and all(ipaddress.ip_address(a).is_loopback for a in addrs)


def is_local_only(host: str) -> bool:
    """Is ``host`` a loopback address on *every* machine (127.0.0.0/8, ::1, localhost)?

    Only then are all agents of a job known to run on this machine. A host name that
    resolves to loopback here (Debian maps the machine's own name to 127.0.1.1) may be a
    real address on the other nodes.
    """
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def route_source(host: str, port: int) -> str | None:
    """The local address this machine's route to ``host`` leaves from (no packet sent)."""
    for addr in resolve(host):
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((addr, port or 9))
                return str(s.getsockname()[0])
        except OSError:
            continue
    return None


def choose(bind: str | None, endpoint_host: str, endpoint_port: int,
           hosts_store: bool, multi_node: bool = False) -> BindPlan:
    """This node's :class:`BindPlan` (see the module docstring for the rules).

    ``multi_node``: other nodes will join (``--nnodes`` > 1), so node 0 must not bind a
    loopback address that its host name happens to resolve to here.
    """
    local = local_addresses()
    if bind is not None and bind.strip().lower() in ALL_INTERFACES:
        return BindPlan(None, None, "--bind all")
    if bind:
        addr = _local_one(bind, local)
        if addr is None:
            raise BindError(f"--bind {bind!r}: not an address of this machine "
                            f"(its addresses: {', '.join(sorted(local)) or 'none found'})")
        return BindPlan(addr, local[addr], f"--bind {bind}")
    if is_local_only(endpoint_host) or (not multi_node and is_loopback(endpoint_host)):
        addr = resolve(endpoint_host)[0]
        return BindPlan(addr, local.get(addr), "the endpoint is a loopback address")
    if hosts_store and is_loopback(endpoint_host):
        raise BindError(
            f"the rendezvous endpoint host {endpoint_host!r} resolves to "
            f"{', '.join(resolve(endpoint_host))} (loopback) on this node, where the other "
            "nodes cannot reach the job store: give the endpoint as this node's network "
            "address, or pass --bind ADDRESS (or --bind all)")
    if hosts_store:
        addr = _local_one(endpoint_host, local)
        if addr is None:
            raise BindError(
                f"the rendezvous endpoint host {endpoint_host!r} "
                f"({', '.join(resolve(endpoint_host)) or 'does not resolve'}) is not an address "
                "of this machine, so node 0 cannot bind the job store to it: pass --bind "
                "ADDRESS (an address of this node the other nodes reach) or --bind all")
        return BindPlan(addr, local[addr], "the rendezvous endpoint's address")
    addr = route_source(endpoint_host, endpoint_port)
    if addr is None or addr not in local:
        return BindPlan(None, None, f"no route to {endpoint_host}; gloo's default")
    return BindPlan(addr, local[addr], f"the address this node reaches {endpoint_host} from")


def _local_one(host: str, local: dict[str, str]) -> str | None:
    for addr in resolve(host):
        if addr in local:
            return addr
    return None


def listening_socket(address: str, port: int) -> socket.socket:
    """A TCP socket bound to ``address:port`` and listening (port 0: a free one)."""
    infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM,
                               flags=socket.AI_PASSIVE | socket.AI_NUMERICHOST)
    family, socktype, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, socktype, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock
