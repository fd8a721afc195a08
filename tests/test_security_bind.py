"""Every listening socket of a real run is on the chosen interface, none on 0.0.0.0 or ::.

A run listens in two places: the job store in node 0's agent (a c10d TCPStore server,
which by itself listens on every interface) and each worker's gloo groups (the training
group and the replication side channel). The listeners are read with psutil from the
real processes while they train; a control checks that the same probe does see a
wildcard listener when there is one, so the test cannot pass by seeing nothing.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from launcher import bind, job_store
from tests.helpers.mp import free_port
from tests.recovery_harness import REPO, TRAIN_ARGS, clean_env

WILDCARDS = {"0.0.0.0", "::"}


def listeners(root_pids: list[int]) -> set[tuple[int, str, int]]:
    """(pid, address, port) of every TCP listener of these processes and their children."""
    procs: list[psutil.Process] = []
    for pid in root_pids:
        try:
            p = psutil.Process(pid)
            procs += [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    found = set()
    for p in procs:
        try:
            conns = p.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                found.add((p.pid, c.laddr.ip.split("%")[0], c.laddr.port))
    return found


def test_the_probe_sees_wildcards_and_host_store_binds_one_address():
    wild = job_store.host_store("127.0.0.1", 0, address=None)  # c10d's own behaviour
    bound = job_store.host_store("127.0.0.1", 0, address="127.0.0.1")
    found = {(ip, port) for _, ip, port in listeners([os.getpid()])}
    assert any(ip in WILDCARDS and port == wild.port for ip, port in found), found
    assert ("127.0.0.1", bound.port) in found
    assert not any(ip in WILDCARDS and port == bound.port for ip, port in found)
    client = job_store.connect_store("127.0.0.1", bound.port, timeout_s=10)
    client.set("k", "v")
    assert bound.get("k") == b"v"


def test_bind_rules():
    lo = bind.choose(None, "127.0.0.1", 29500, hosts_store=True)
    assert lo.address == "127.0.0.1" and lo.gloo_ifname is not None
    assert bind.choose(None, "localhost", 29500, hosts_store=False).address is not None
    assert bind.choose("all", "10.0.0.1", 29500, hosts_store=True).address is None
    with pytest.raises(bind.BindError, match="not an address of this machine"):
        bind.choose("203.0.113.77", "127.0.0.1", 29500, hosts_store=True)
    with pytest.raises(bind.BindError, match="node 0 cannot bind the job store"):
        bind.choose(None, "203.0.113.77", 29500, hosts_store=True)
    # "localhost" is loopback everywhere; a host name that maps to loopback only here is
    # not, when other nodes will join
    assert bind.is_local_only("localhost") and bind.is_local_only("127.0.0.2")
    assert bind.is_local_only("::1") and not bind.is_local_only(socket.gethostname())
    if bind.is_loopback(socket.gethostname()):
        with pytest.raises(bind.BindError, match="other nodes cannot reach the job store"):
            bind.choose(None, socket.gethostname(), 29500, hosts_store=True, multi_node=True)
        assert bind.choose(None, socket.gethostname(), 29500, hosts_store=True).address


def test_a_bad_bind_address_is_a_usage_error(capsys):
    from launcher.cli import main

    assert main(["run", "--standalone", "--bind", "203.0.113.77", "examples/train_gpt.py"]) == 2
    err = capsys.readouterr().err
    assert "--bind '203.0.113.77': not an address of this machine" in err
    assert "Traceback" not in err


def _non_loopback_ipv4() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    return None


def _run_and_probe(tmp_path: Path, host: str | None, nnodes: int) -> tuple[set, list[int]]:
    """Start a job (2 workers in all), probe its listeners while it trains, let it end."""
    run_dir = tmp_path / "run"
    env = {**clean_env(), "CHECKPOINTLESS_JOB_SECRET": "bind-test-secret-" + "7" * 20}
    port = free_port()
    procs = []
    for node in range(nnodes):
        where = (["--standalone"] if host is None else
                 ["--nnodes", str(nnodes), "--node-rank", str(node),
                  "--rdzv-endpoint", f"{host}:{port}", "--rdzv-id", "bindtest"])
        cmd = [sys.executable, "-m", "launcher.cli", "run", *where,
               "--nproc-per-node", str(2 // nnodes), "--run-dir", str(run_dir),
               "--rdzv-conf", "join_timeout=60", "examples/train_gpt.py", *TRAIN_ARGS,
               "--step-sleep", "0.2"]
        log = open(tmp_path / f"agent{node}.log", "wb")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True), log))
    found: set = set()
    try:
        events = run_dir / "events.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            text = events.read_text() if events.exists() else ""
            steps = [json.loads(ln) for ln in text.splitlines() if '"event": "step"' in ln]
            if steps and steps[-1]["step"] >= 3:
                break
            time.sleep(0.1)
        for _ in range(5):
            found |= listeners([p.pid for p, _ in procs])
            time.sleep(0.2)
        codes = [p.wait(timeout=120) for p, _ in procs]
    finally:
        for p, log in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
            log.close()
    logs = "\n".join((tmp_path / f"agent{n}.log").read_text() for n in range(nnodes))
    assert codes == [0] * nnodes, logs
    return found, [p.pid for p, _ in procs]


def _assert_bound(found: set, agent_pids: list[int], address: str) -> None:
    assert found, "no listener found at all"
    store = [f for f in found if f[0] == agent_pids[0]]
    workers = [f for f in found if f[0] not in agent_pids]
    # node 0's agent: the job store, and the socket its watchers hold connections to
    # (launcher/peer_link.py); every other agent: that socket only
    assert len(store) == 2, f"expected the job store and a peer link in node 0: {sorted(found)}"
    assert all(len([f for f in found if f[0] == pid]) == 1 for pid in agent_pids[1:]), found
    # each worker: a gloo training group and a gloo replication side channel
    assert len({pid for pid, _, _ in workers}) == 2 and len(workers) >= 4, sorted(found)
    bad = sorted(f for f in found if f[1] != address)
    assert not bad, f"listeners off {address}: {bad}"
    assert not any(f[1] in WILDCARDS for f in found)


@pytest.mark.timeout(240)
def test_a_single_node_run_listens_on_loopback_only(tmp_path):
    found, pids = _run_and_probe(tmp_path, None, 1)
    _assert_bound(found, pids, "127.0.0.1")


@pytest.mark.timeout(240)
def test_a_two_node_run_listens_on_the_endpoint_interface_only(tmp_path):
    address = _non_loopback_ipv4()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    found, pids = _run_and_probe(tmp_path, address, 2)
    _assert_bound(found, pids, address)
