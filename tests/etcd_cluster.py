"""Real etcd members on loopback for tests: 1 or 3 of them, free ports, temp data dirs.

``with EtcdCluster(3) as cluster:`` starts the members, waits until the cluster
answers a linearizable read, and on exit (failure included) kills every member it
started and removes its data directories. :meth:`EtcdCluster.stop` and
:meth:`EtcdCluster.start` take one member down and bring it back, for failover tests.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ETCD = os.environ.get("ETCD_BINARY", "/usr/bin/etcd")


def etcd_missing_reason() -> str | None:
    """Why etcd tests cannot run here, or None when they can."""
    if not os.access(ETCD, os.X_OK):
        return f"{ETCD} is not installed (apt-get install etcd-server)"
    return None


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class EtcdCluster:
    """``size`` etcd members on ``host`` (127.0.0.1), each with its own client and peer
    port. ``launch_prefix`` runs them inside something, e.g. ``ip netns exec NS`` for a
    member on its own network host (``tests/netns.py``); the health probe then runs
    there too, since the test process may not reach that address."""

    def __init__(self, size: int = 1, startup_timeout: float = 20.0, *,
                 host: str = "127.0.0.1", launch_prefix: list[str] | None = None) -> None:
        self.size = size
        self.startup_timeout = startup_timeout
        self.host = host
        self.launch_prefix = list(launch_prefix or [])
        ports = _free_ports(2 * size)
        self.client_ports, self.peer_ports = ports[:size], ports[size:]
        self.root = Path(tempfile.mkdtemp(prefix="etcd-test-"))
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * size
        self.names = [f"m{i}" for i in range(size)]

    @property
    def endpoints(self) -> list[str]:
        return [f"{self.host}:{p}" for p in self.client_ports]

    def _argv(self, i: int) -> list[str]:
        h = self.host
        initial = ",".join(f"{n}=http://{h}:{p}" for n, p in zip(self.names, self.peer_ports))
        client = f"http://{h}:{self.client_ports[i]}"
        peer = f"http://{h}:{self.peer_ports[i]}"
        return [*self.launch_prefix, ETCD, "--name", self.names[i],
                "--data-dir", str(self.root / self.names[i]),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", initial, "--initial-cluster-token", self.root.name,
                "--initial-cluster-state", "new", "--log-level", "error",
                "--heartbeat-interval", "50", "--election-timeout", "500"]

    def start(self, i: int | None = None) -> None:
        """Start member ``i`` (every member when None) and wait until the cluster answers."""
        for j in range(self.size) if i is None else [i]:
            if self.procs[j] is None:
                log = open(self.root / f"{self.names[j]}.log", "ab")  # noqa: SIM115
                self.procs[j] = subprocess.Popen(self._argv(j), stdout=log, stderr=log)
                log.close()
        self.wait_healthy(i)

    def stop(self, i: int) -> None:
        """Kill member ``i`` (SIGKILL: a crash, not a clean leave)."""
        proc = self.procs[i]
        if proc is not None:
            proc.kill()
            proc.wait()
            self.procs[i] = None

    def leader(self) -> int:
        """The index of the member that leads the cluster now."""
        for j, proc in enumerate(self.procs):
            if proc is None:
                continue
            req = urllib.request.Request(f"http://{self.endpoints[j]}/v3/maintenance/status",
                                         data=b"{}", method="POST")
            with urllib.request.urlopen(req, timeout=2.0) as resp:
                status = json.load(resp)
            if status.get("leader") == status["header"]["member_id"]:
                return j
        raise RuntimeError("no running etcd member leads the cluster")

    def wait_healthy(self, member: int | None = None) -> None:
        """Until ``member`` (when None: any running member) serves a linearizable read,
        which needs the cluster to have quorum and that member to have joined it."""
        deadline = time.monotonic() + self.startup_timeout
        last = ""
        while time.monotonic() < deadline:
            for j, proc in enumerate(self.procs):
                if proc is None or member not in (None, j):
                    continue
                if proc.poll() is not None:
                    log = (self.root / f"{self.names[j]}.log").read_text()
                    raise RuntimeError(f"etcd member {j} exited: {log[-2000:]}")
                if self.launch_prefix:
                    if self._probe_inside(j):
                        return
                    continue
                try:
                    req = urllib.request.Request(
                        f"http://{self.endpoints[j]}/v3/kv/range", data=json.dumps(
                            {"key": "aGVhbHRo"}).encode(), method="POST")
                    with urllib.request.urlopen(req, timeout=1.0) as resp:
                        if resp.status == 200:
                            return
                except OSError as exc:
                    last = repr(exc)
            time.sleep(0.05)
        raise RuntimeError(f"etcd cluster not healthy after {self.startup_timeout}s: {last}")

    def _probe_inside(self, j: int) -> bool:
        """The health read of :meth:`wait_healthy`, run under ``launch_prefix``."""
        code = ("import json, sys, urllib.request as u; "
                f"r = u.Request('http://{self.endpoints[j]}/v3/kv/range', "
                "data=json.dumps({'key': 'aGVhbHRo'}).encode(), method='POST'); "
                "sys.exit(0 if u.urlopen(r, timeout=1.0).status == 200 else 1)")
        done = subprocess.run([*self.launch_prefix, sys.executable, "-c", code],
                              capture_output=True, timeout=10)
        return done.returncode == 0

    def close(self) -> None:
        for i in range(self.size):
            try:
                self.stop(i)
            except OSError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
