"""A network partition between real network hosts: each node in its own namespace.

``tests/netns.py`` puts every node of a job in its own network namespace on one
bridge; cutting a node's link stops its packets both ways while its processes keep
running, and no peer ever sees a FIN or an RST (the smoke test proves that on a plain
TCP connection). The job test then cuts node 1 of a 2-node job with a spare node in
the middle of training: its loss must be detected (at a 3 s heartbeat timeout, before
ADR 0036's keepalives end the connections; a second test runs at the default timeout,
where they do), node 1 must fence itself (its workers stop; its agent leaves with
EXIT_FENCED once the link is back and it sees the takeover), the spare node runs its
ranks, and the job must end
bit-identical to a failure-free run of the same job in the same namespaces.

Needs root for ``ip netns``: skipped otherwise, unless ``TESTS_REQUIRE_NETNS=1`` (CI).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests import netns
from tests.lab_jobs import STORE_PORT, run_in_lab, wait_events
from tests.recovery_harness import (
    REPO,
    assert_same_final,
    assert_succeeded,
    clean_env,
)

pytestmark = pytest.mark.timeout(240)

_why_not = netns.available()
if _why_not is not None:
    if os.environ.get("TESTS_REQUIRE_NETNS") == "1":
        raise RuntimeError(f"TESTS_REQUIRE_NETNS=1 but network namespaces are unusable: "
                           f"{_why_not}")
    pytest.skip(f"network namespaces unusable: {_why_not}", allow_module_level=True)



@pytest.fixture
def lab() -> Iterator[netns.NetLab]:
    with netns.NetLab(3) as made:
        yield made
    assert not netns.namespaces_of(os.getpid()), "a namespace was left behind"


# --- (a) the cut itself ----------------------------------------------------------------
ECHO_SERVER = textwrap.dedent("""
    import socket, sys, threading
    srv = socket.create_server((sys.argv[1], 7000))
    print("listening", flush=True)
    def echo(c):
        while (d := c.recv(100)):
            c.sendall(d)
    while True:
        threading.Thread(target=echo, args=(srv.accept()[0],), daemon=True).start()
""")

#: Connects, then follows the test's lines on stdin; prints what it saw, one word a step.
PROBE = textwrap.dedent("""
    import socket, sys
    c = socket.create_connection((sys.argv[1], 7000), timeout=5)
    c.sendall(b"a"); print("echo", c.recv(10).decode(), flush=True)
    sys.stdin.readline()  # the link is cut now
    c.settimeout(2.0)
    c.sendall(b"b")
    try:
        c.recv(10); print("answered", flush=True)
    except TimeoutError:
        print("silent", flush=True)
    except OSError as e:
        print("error", type(e).__name__, flush=True)
    try:
        socket.create_connection((sys.argv[1], 7000), timeout=2.0); print("connected", flush=True)
    except TimeoutError:
        print("connect-timeout", flush=True)
    except OSError as e:
        print("connect-error", type(e).__name__, flush=True)
    sys.stdin.readline()  # the link is back
    c.settimeout(15.0)
    print("after", c.recv(10).decode(), flush=True)  # retransmitted, not lost
""")


def test_cut_link_is_silent_both_ways_and_restores(lab):
    py = sys.executable
    ping = lab.run(2, [py, "-c", "import socket; socket.create_connection"
                       f"(('{lab.addr(0)}', 9), timeout=3)"], capture_output=True, text=True)
    assert "ConnectionRefused" in ping.stderr, f"node 2 cannot reach node 0: {ping.stderr}"
    server = subprocess.Popen([*lab.prefix(0), py, "-c", ECHO_SERVER, lab.addr(0)],
                              stdout=subprocess.PIPE, text=True)
    probe = None
    try:
        assert server.stdout.readline().strip() == "listening"
        probe = subprocess.Popen([*lab.prefix(1), py, "-c", PROBE, lab.addr(0)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert probe.stdout.readline().split() == ["echo", "a"]
        lab.cut(1)
        probe.stdin.write("cut\n")
        probe.stdin.flush()
        # No RST, no FIN, no "no route to host": just silence, both ways.
        assert probe.stdout.readline().split() == ["silent"]
        assert probe.stdout.readline().split() == ["connect-timeout"]
        lab.restore(1)
        probe.stdin.write("restored\n")
        probe.stdin.flush()
        # The connection survived the cut: TCP retransmitted what was queued.
        assert probe.stdout.readline().split() == ["after", "b"]
        assert probe.wait(timeout=10) == 0
    finally:
        for p in (probe, server):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_namespaces_of_a_crashed_run_are_swept():
    """A run that dies without cleaning up (os._exit skips atexit) leaves its namespaces;
    the next run's sweep deletes them, and only those of dead pids."""
    made = subprocess.run(
        [sys.executable, "-c", "import os; from tests.netns import NetLab; "
         "lab = NetLab(2).start(); print(os.getpid(), flush=True); os._exit(0)"],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    dead = int(made.stdout.strip())
    assert len(netns.namespaces_of(dead)) == 3
    with netns.NetLab(1, tag="mine"):
        mine = netns.namespaces_of(os.getpid())
        assert mine and not netns.namespaces_of(dead), "the sweep left a dead run's namespaces"
        netns.sweep()
        assert netns.namespaces_of(os.getpid()) == mine, "the sweep took a live run's"


# --- (b) a job across namespaces ---------------------------------------------------------
def _recovered_with(ranks: list[int]) -> Callable[[list[dict]], bool]:
    def done(events: list[dict]) -> bool:
        recs = [e for e in events if e.get("event") == "recovery"]
        if not recs:
            return False
        gen = max(e["gen"] for e in recs)
        last = [e for e in recs if e["gen"] == gen]
        return len(last) == 4 and sorted(e["rank"] for e in last if e["newcomer"]) == ranks
    return done


def _cut_at_step_3(lab: netns.NetLab, run_dir: Path, node: int, marks: dict[str, float],
                   ranks: list[int]) -> None:
    """Once training reaches step 3, cut ``node``'s link (the time goes to
    ``marks["cut"]``) and wait for the recovery that gives ``ranks`` to the spare node."""
    wait_events(run_dir, lambda ev: any(e.get("event") == "step" and e["step"] >= 3
                                         for e in ev), "training to reach step 3")
    marks["cut"] = time.time()
    lab.cut(node)
    wait_events(run_dir, _recovered_with(ranks),
                 f"the recovery with ranks {ranks} on the spare node")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone too: it only waits to be reaped
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_partitioned_node_is_fenced_and_the_job_recovers(lab, tmp_path):
    """Cut node 1's link at step 3 (processes keep running), restore it after the job
    recovered on node 0 and spare node 2; the job ends bit-identical."""
    reference = run_in_lab(lab, tmp_path / "reference", nnodes=2, spare_nodes=0,
                           timeout_s=90)
    assert_succeeded(reference)
    assert sorted(reference.finals()) == [0, 1, 2, 3]
    assert not reference.events("recovery"), "the failure-free run recovered from something"
    stores = [e["store"] for e in reference.events("agent_start")]
    assert stores == [f"{lab.addr(0)}:{STORE_PORT}"] * 2, stores

    marks: dict[str, float] = {}

    def partition(run_dir: Path) -> None:
        _cut_at_step_3(lab, run_dir, 1, marks, [2, 3])
        # and node 1 has stopped its workers on its own: with workers forked from the
        # zygote, the takeover can complete before node 1's lease runs out (ADR 0029)
        wait_events(run_dir, lambda ev: any(e.get("event") == "node_isolated" for e in ev),
                     "node 1 to fence itself")
        marks["restore"] = time.time()
        lab.restore(1)

    job = run_in_lab(lab, tmp_path / "run", nnodes=2, spare_nodes=1, timeout_s=150,
                     during=partition)
    assert job.returncodes[1] == 4, (
        f"node 1 should leave fenced (exit 4): {job.returncodes}\n{job.output()}")
    assert_succeeded(job, except_nodes=(1,))
    assert_same_final(reference, job)

    lost = job.events("node_lost")
    assert lost and {e["lost_node"] for e in lost} == {1}, lost
    assert [(e["node"], e["group"]) for e in job.events("node_takeover")] == [(2, 1)]
    isolated = job.events("node_isolated")
    assert [e["node"] for e in isolated] == [1], isolated
    fenced = job.events("node_fenced")
    if marks["restore"] - marks["cut"] < 25:  # back before its store operation timed out
        assert [(e["node"], e["taken_over_by"]) for e in fenced] == [(1, 2)], fenced
    else:  # cut off until the store timeout (30 s): it leaves fenced without seeing it
        assert "leaving the job fenced" in job.agents[1].stderr, job.output()
    recs = job.events("recovery")
    newest = max(e["gen"] for e in recs)
    last = [e for e in recs if e["gen"] == newest]
    assert last[0]["providers"] == {"2": 0, "3": 1}, "node 1's replicas live on node 0"
    done = job.events("job_done")
    assert done and all(e["failures"] == 1 for e in done), done
    # Node 1's workers stopped (by its own agent), and nothing of node 1 is left.
    node1_pids = [e["pid"] for e in job.events("worker_start") if e["node"] == 1]
    assert node1_pids and not [p for p in node1_pids if _alive(p)], node1_pids
    assert all(e["ts"] < marks["restore"] for e in isolated), "fenced only after the restore"

    detect = min(e["ts"] for e in lost) - marks["cut"]
    self_fence = isolated[0]["ts"] - marks["cut"]
    recovered = max(e["ts"] for e in last) - marks["cut"]
    print(f"\npartition of node 1: detected (node_lost) {detect:.2f}s after the cut, "
          f"node 1 fenced itself after {self_fence:.2f}s, job recovered on the spare node "
          f"{recovered:.2f}s after the cut ({recovered - detect:.2f}s after detection); "
          f"link restored at {marks['restore'] - marks['cut']:.2f}s")
    assert 2.5 < detect < 10, f"detection took {detect:.2f}s with a 3 s heartbeat timeout"


def test_a_partition_is_detected_before_the_heartbeat_timeout(lab, tmp_path):
    """At the default liveness settings (heartbeat timeout 15 s), cut node 1's link at
    step 3: the watchers' held connections to its agent fail their TCP keepalive (its
    kernel answers nothing), and with its heartbeat silent too it is declared lost in
    about 6 s, not 15 (``launcher/peer_link.py``). Its ranks move to the spare node and
    the job finishes. A stopped agent, whose kernel still answers, is the control
    (``tests/test_peer_link.py``)."""
    marks: dict[str, float] = {}

    def partition(run_dir: Path) -> None:
        _cut_at_step_3(lab, run_dir, 1, marks, [2, 3])
        lab.restore(1)

    job = run_in_lab(lab, tmp_path / "run", nnodes=2, spare_nodes=1, timeout_s=150,
                     during=partition, overrides=())
    assert_succeeded(job, except_nodes=(1,))
    assert sorted(job.finals()) == [0, 1, 2, 3]
    lost = job.events("node_lost")
    assert lost and {e["lost_node"] for e in lost} == {1}, lost
    detect = min(e["ts"] for e in lost) - marks["cut"]
    print(f"\npartition of node 1 at the default 15 s heartbeat timeout: declared lost "
          f"{detect:.2f}s after the cut")
    # whichever watcher saw it first says why (the others learn it from its publication)
    assert any("its agent's connection closed" in a.stderr for a in job.agents.values()), (
        job.output())
    assert detect <= 8.0, f"a partition took {detect:.2f}s to detect (target 8 s)"


# --- (c) under etcd: the node that hosted the store under c10d is an ordinary node ------
@pytest.fixture
def etcd_lab() -> Iterator[tuple[netns.NetLab, str]]:
    """Nodes 0-2 for agents, namespace 3 for a one-member etcd cluster of its own."""
    from tests.etcd_cluster import EtcdCluster, etcd_missing_reason

    missing = etcd_missing_reason()
    if missing:
        if os.environ.get("TESTS_REQUIRE_ETCD") == "1":
            pytest.fail(f"{missing}, and TESTS_REQUIRE_ETCD=1")
        pytest.skip(missing)
    with (netns.NetLab(4, tag="etcd") as made,
          EtcdCluster(1, host=made.addr(3), launch_prefix=made.prefix(3)) as cluster):
        yield made, ",".join(cluster.endpoints)
    assert not netns.namespaces_of(os.getpid()), "a namespace was left behind"


def test_partitioned_node_0_under_etcd_is_fenced_and_the_job_recovers(etcd_lab, tmp_path):
    """Under etcd, cut node 0 (the store host under c10d, where its loss ends the job):
    its lease expires, it fences itself, spare node 2 takes ranks 0 and 1 over, and the
    job ends bit-identical to a failure-free run in the same namespaces."""
    lab, endpoints = etcd_lab
    reference = run_in_lab(lab, tmp_path / "reference", nnodes=2, spare_nodes=0,
                           timeout_s=90, etcd=endpoints)
    assert_succeeded(reference)
    assert not reference.events("recovery"), "the failure-free run recovered from something"

    marks: dict[str, float] = {}

    def partition(run_dir: Path) -> None:
        _cut_at_step_3(lab, run_dir, 0, marks, [0, 1])
        # and node 0 has stopped its workers on its own: with workers forked from the
        # zygote, the takeover can complete before node 0's lease runs out (ADR 0029)
        wait_events(run_dir, lambda ev: any(e.get("event") == "node_isolated" for e in ev),
                     "node 0 to fence itself")
        marks["restore"] = time.time()
        lab.restore(0)

    job = run_in_lab(lab, tmp_path / "run", nnodes=2, spare_nodes=1, timeout_s=150,
                     during=partition, etcd=endpoints)
    assert job.returncodes[0] == 4, (
        f"node 0 should leave fenced (exit 4): {job.returncodes}\n{job.output()}")
    assert_succeeded(job, except_nodes=(0,))
    assert_same_final(reference, job)
    lost = job.events("node_lost")
    assert lost and {e["lost_node"] for e in lost} == {0}, lost
    assert [(e["node"], e["group"]) for e in job.events("node_takeover")] == [(2, 0)]
    assert [e["node"] for e in job.events("node_isolated")] == [0]
    node0_pids = [e["pid"] for e in job.events("worker_start") if e["node"] == 0]
    assert node0_pids and not [p for p in node0_pids if _alive(p)], node0_pids
    recs = job.events("recovery")
    newest = max(e["gen"] for e in recs)
    last = [e for e in recs if e["gen"] == newest]
    detect = min(e["ts"] for e in lost) - marks["cut"]
    recovered = max(e["ts"] for e in last) - marks["cut"]
    print(f"\netcd, partition of node 0: detected {detect:.2f}s after the cut, recovered "
          f"on the spare node {recovered:.2f}s after the cut")
    assert 2.5 < detect < 10, f"detection took {detect:.2f}s with a 3 s heartbeat timeout"
