"""``persistence.path`` is checked before training starts.

Before: a read-only directory was found out only by the saves (one error each, exit 0
with no checkpoint), and an S3 endpoint that was down cost 77 s of botocore tracebacks
before the job stopped on a line that never named storage. Each agent now writes,
reads back and deletes a probe object first. Real parts: a read-only tmpfs mount (the
suite runs as root, for whom a chmod'ed directory is still writable), moto's S3 server,
and a closed port for the endpoint that is down.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from replication.durable.probe import probe_storage
from tests.helpers.mp import free_port
from tests.recovery_harness import REPO, clean_env
from tests.s3_server import moto_s3

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def read_only_dir(tmp_path):
    mount = tmp_path / "ro"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "none", str(mount)],
                   check=True)
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_writable_directory_passes_and_keeps_nothing(tmp_path):
    assert probe_storage(str(tmp_path / "ckpt")) is None
    assert list((tmp_path / "ckpt").iterdir()) == []


def test_a_read_only_directory_is_one_line(read_only_dir):
    problem = probe_storage(str(read_only_dir / "ckpt"))
    assert problem is not None and "\n" not in problem
    assert problem.startswith(f"persistence.path '{read_only_dir / 'ckpt'}' failed its "
                              "start-up check while creating the directory: OSError"), problem
    assert "Read-only file system" in problem


def test_a_path_below_a_file_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    problem = probe_storage(str(tmp_path / "file" / "ckpt"))
    assert problem is not None and "NotADirectoryError" in problem, problem


@pytest.mark.s3
def test_s3_that_answers_passes_and_keeps_nothing():
    with moto_s3() as server:
        assert probe_storage(server.url("probe"), server.storage_options) is None
        assert server.filesystem().find(server.url("probe")) == []


def test_s3_endpoint_down_is_reported_within_the_deadline():
    opts = {"key": "k", "secret": "s", "client_kwargs": {
        "endpoint_url": f"http://127.0.0.1:{free_port()}", "region_name": "us-east-1"}}
    t0 = time.monotonic()
    problem = probe_storage("s3://bucket/ckpt", opts, timeout_s=4.0)
    took = time.monotonic() - t0
    assert took < 6.0, took
    assert problem is not None and problem.startswith("persistence.path 's3://bucket/ckpt' ")
    assert "did not answer within 4s" in problem or "EndpointConnectionError" in problem


def _agent_start_s() -> float:
    """What a new agent costs before it can check anything: a fresh interpreter that
    imports the agent (torch with it), timed now, on this host as loaded as it is."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import launcher.agent"], cwd=REPO, env=clean_env(),
                   check=True, timeout=90)
    return time.monotonic() - t0


def test_the_job_stops_before_any_worker_starts(read_only_dir, tmp_path):
    """A storage path the job cannot write stops it at once, before any worker starts:
    within a few agents' start-up (measured in the same test, so a loaded host is
    allowed for) plus the probe's own 4 s deadline, not after the workers' retries."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "launcher.cli", "run", "--standalone", "--nproc-per-node",
           "2", "--run-dir", str(run_dir), f"persistence.path={read_only_dir}/ckpt",
           str(REPO / "tests" / "user_scripts" / "bug_at_step.py")]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=90)
    took = time.monotonic() - t0
    start = _agent_start_s()
    assert proc.returncode != 0 and took < 3 * start + 4.0, (proc.returncode, took, start,
                                                              proc.stderr)
    failed = [line for line in proc.stderr.splitlines() if "job failed" in line]
    assert len(failed) == 1 and "failed its start-up check" in failed[0], (
        f"exit status {proc.returncode} after {took:.1f}s\n{proc.stderr}")
    assert "Read-only file system" in failed[0]
    events = Path(run_dir / "events.jsonl").read_text()
    assert '"worker_start"' not in events, "a worker started before the storage check"


def test_a_job_whose_s3_endpoint_is_down_stops_before_training_with_one_line(tmp_path):
    """A reported case: ``persistence.path=s3://...`` with the endpoint down cost 77 s
    of botocore tracebacks, then the generic max_restarts line. Now: no worker starts,
    and the job stops within the probe's deadline with one line naming
    persistence.path."""
    from tests.recovery_harness import run_job

    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    options = ("persistence.storage_options={key: k, secret: s, client_kwargs: "
               f"{{endpoint_url: '{endpoint}', region_name: us-east-1}}}}")
    job = run_job(tmp_path / "run", nproc=2, timeout_s=60,
                  overrides=["persistence.path=s3://bucket/ckpt", options])
    assert not job.timed_out, job.output()
    assert job.returncodes[0] not in (0, None), job.returncodes
    assert job.elapsed_s < 35, f"took {job.elapsed_s:.1f}s"
    assert not job.events("worker_start"), "a worker started before the storage check"
    err = job.agents[0].stderr
    failed = [line for line in err.splitlines() if "job failed" in line]
    assert len(failed) == 1 and "persistence.path 's3://bucket/ckpt'" in failed[0], err
    assert "Traceback" not in err and "max_restarts" not in err, err[-3000:]


def _remount_read_only_when_training(mount: Path):
    """A ``during`` hook: once the agent starts a worker (its storage check passed; the
    worker still has seconds of imports before its first step), make the storage
    read-only, so every save of the run fails."""
    def hook(run_dir: Path) -> None:
        events = run_dir / "events.jsonl"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if events.exists() and '"worker_start"' in events.read_text():
                subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
                return
            time.sleep(0.05)
        raise AssertionError("no worker started")
    return hook


def test_a_run_that_persisted_nothing_says_so_last_and_exits_non_zero(tmp_path):
    """Storage that breaks after the start-up check: training is not stopped by it, the
    saves fail loudly, and the last line says nothing was persisted (exit status 1)."""
    from tests.recovery_harness import run_job

    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "none", str(mount)], check=True)
    try:
        job = run_job(tmp_path / "run", nproc=2, timeout_s=120,
                      script_args=("--steps", "24", "--dim", "32", "--layers", "1",
                                   "--batch", "4", "--seq-len", "16"),
                      overrides=[f"persistence.path={mount}/ckpt",
                                 "persistence.every_n_steps=4"],
                      during=_remount_read_only_when_training(mount))
    finally:
        subprocess.run(["umount", str(mount)], check=True)
    assert not job.timed_out, job.output()
    assert job.returncodes[0] == 1, job.output()
    assert [e["step"] for e in job.events("worker_done")] == [24, 24], "training was stopped"
    err = job.agents[0].stderr
    assert "DURABLE CHECKPOINT FAILED" in err, err[-3000:]
    assert "durable: nothing persisted" in err, err[-3000:]
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert last.startswith("checkpointless: job done but NOTHING WAS PERSISTED"), last


def _events_named(run_dir: Path, name: str) -> list[dict]:
    from recovery.generation.protocol import read_events

    path = run_dir / "events.jsonl"
    return [e for e in read_events(path) if e.get("event") == name] if path.exists() else []


def _wait_event(run_dir: Path, name: str, what: str, timeout_s: float = 60.0, **match):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [e for e in _events_named(run_dir, name)
                 if all(e.get(k) == v for k, v in match.items())]
        if found:
            return found[0]
        if _events_named(run_dir, "job_done") or _events_named(run_dir, "job_failed"):
            raise AssertionError(f"the job ended before {what}")
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout_s:.0f}s")


def test_a_spare_node_joining_during_a_storage_outage_joins_and_takes_over(tmp_path):
    """The start-up check ends the job only before it has begun. The chaos soak's seed 1
    (at CI's step time) started its spare node during a storage outage, and the probe's
    failure ended a job that had trained 150 steps: a passing outage turned into a total
    loss. A node joining a running job now logs the failure and joins; here it then takes
    over a lost node's ranks and the job completes."""
    import os
    import signal

    from tests.recovery_harness import assert_succeeded, run_job

    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "none", str(mount)], check=True)

    def during(run_dir: Path, start_spare_node) -> None:
        _wait_event(run_dir, "step", "a step", step=5)
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)  # the outage
        start_spare_node()
        _wait_event(run_dir, "storage_check_failed", "the spare's failed storage check",
                    node=2)
        _wait_event(run_dir, "agent_start", "the spare node's start", node=2)
        subprocess.run(["mount", "-o", "remount,rw", str(mount)], check=True)  # it ends
        node1 = _wait_event(run_dir, "agent_start", "node 1's start", node=1)
        os.killpg(node1["pid"], signal.SIGKILL)  # node 1 is lost: agent and workers
        _wait_event(run_dir, "node_takeover", "the spare's takeover", node=2)

    try:
        job = run_job(tmp_path / "run", nnodes=2, nproc=1, late_spare_nodes=1, timeout_s=110,
                      script_args=("--steps", "400", "--dim", "32", "--layers", "1",
                                   "--batch", "4", "--seq-len", "16", "--step-sleep", "0.05"),
                      overrides=[f"persistence.path={mount}/ckpt",
                                 "persistence.every_n_steps=20",
                                 "recovery.heartbeat_timeout_s=3",
                                 "recovery.heartbeat_interval_s=0.2"],
                      during=during)
    finally:
        subprocess.run(["umount", str(mount)], check=True)
    assert_succeeded(job, except_nodes=(1,))
    assert "is already running, so this node joins it" in job.agents[2].stderr
    assert [e["step"] for e in job.events("worker_done")] == [400, 400], job.output()


_FUZZ_ROOT = Path("/tmp/checkpointless-probe-fuzz")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prefix=st.sampled_from([f"{_FUZZ_ROOT}/", f"file://{_FUZZ_ROOT}/", "memory://",
                               "nope://", f"{_FUZZ_ROOT}/\x00"]),
       rest=st.text(max_size=40).filter(lambda t: ".." not in t))  # stay inside the root
@example(prefix="", rest="")
def test_any_path_is_a_verdict_of_one_line_never_a_crash(prefix, rest):
    """Malformed URLs and paths (unknown protocols, NUL bytes, surrogates, empty) get
    ``None`` or one line naming ``persistence.path``, within the deadline."""
    t0 = time.monotonic()
    problem = probe_storage(prefix + rest, timeout_s=5.0)
    assert time.monotonic() - t0 < 8.0
    if problem is not None:
        assert problem.startswith("persistence.path ") and "\n" not in problem, problem


def test_the_last_line_tells_storage_it_cannot_read_from_storage_without_checkpoints(tmp_path):
    """A job that ends during a storage outage cannot show that it persisted anything,
    but must not claim that nothing was: the path is there, it just cannot be read
    (the chaos soak's outage re-points it at a file). A path that plainly does not
    exist, or an empty directory, did get nothing."""
    import time

    from launcher.job_outcome import durable_outcome
    from replication.config import PersistenceConfig

    blocked = tmp_path / "unavailable"
    blocked.write_text("outage\n")
    (tmp_path / "durable").symlink_to(blocked)
    (tmp_path / "empty").mkdir()
    now = time.time()
    text, persisted = durable_outcome(PersistenceConfig(path=str(tmp_path / "durable")), now)
    assert persisted is None and "cannot list" in text, text
    for path in (tmp_path / "never_created", tmp_path / "empty"):
        text, persisted = durable_outcome(PersistenceConfig(path=str(path)), now)
        assert persisted is False and "nothing persisted" in text, text
