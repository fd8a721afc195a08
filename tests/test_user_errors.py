"""A user's bug stops the job at once with one line; it is never retried.

Real launcher, 2 workers. Before: a script that raised at import, ``-m`` with a module
that does not exist, or a ``ValueError`` in step 7 were each retried
``recovery.max_restarts`` (10) times and ended with "max_restarts exceeded" under 465
lines of tracebacks, never naming the exception.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.recovery_harness import REPO, agent_command, clean_env, run_job, start_agent

pytestmark = pytest.mark.timeout(120)


def _all_output(job) -> str:
    return "\n".join(a.stdout + a.stderr for a in job.agents.values())


def _assert_stopped_once(job, *, within_s: float) -> str:
    assert not job.timed_out, job.output()
    assert job.returncodes[0] not in (0, None), job.returncodes
    assert job.elapsed_s < within_s, f"took {job.elapsed_s:.1f}s\n{job.output()}"
    assert not job.events("failure_declared"), "a user's bug was treated as a failure"
    starts = job.events("worker_start")
    assert len(starts) == 2, f"a worker was restarted: {starts}"
    text = _all_output(job)
    assert "max_restarts" not in text, text[-3000:]
    # the traceback once (the rank that recorded the failure), not once per rank/retry
    assert text.count("Traceback (most recent call last)") == 1, text[-4000:]
    return text


def test_an_import_error_stops_the_job_with_one_line(tmp_path):
    job = run_job(tmp_path / "run", nproc=2, script="tests/user_scripts/bad_import.py",
                  script_args=(), timeout_s=60)
    text = _assert_stopped_once(job, within_s=30)
    assert ("raised ModuleNotFoundError: No module named 'checkpointless_no_such_module' "
            "(at tests/user_scripts/bad_import.py:3) before its first step") in text, text
    assert "job failed: rank" in text


def test_a_usage_error_stops_the_job_with_one_line(tmp_path):
    """argparse refuses an argument (SystemExit(2) before any step): one usage message
    per rank, one line naming the exit, no retries."""
    job = run_job(tmp_path / "run", nproc=2, script="tests/user_scripts/needs_args.py",
                  script_args=("--no-such-flag",), timeout_s=60)
    assert not job.timed_out, job.output()
    assert job.returncodes[0] not in (0, None), job.returncodes
    assert job.elapsed_s < 30, job.output()
    assert len(job.events("worker_start")) == 2, "a worker was restarted"
    text = _all_output(job)
    assert "max_restarts" not in text and "Traceback" not in text, text[-3000:]
    assert "unrecognized arguments: --no-such-flag" in text, text[-3000:]
    assert "raised SystemExit(2) (the lines above it say why) before its first step" in text


def test_a_missing_module_stops_the_job_with_one_line(tmp_path):
    run_dir = tmp_path / "run"
    cmd = agent_command(node_rank=0, nnodes=1, nproc=2, run_dir=run_dir, endpoint=None,
                        rdzv_id="x", spares=0, overrides=(), script="-m",
                        script_args=("checkpointless_missing.train",))
    agent = start_agent(cmd, 0, run_dir / "logs")
    try:
        rc = agent.proc.wait(timeout=60)
    finally:
        agent.kill()
    text = agent.stdout + agent.stderr
    assert rc != 0, text
    assert "raised ModuleNotFoundError: No module named 'checkpointless_missing'" in text
    assert "before its first step" in text and "max_restarts" not in text
    assert text.count("Traceback (most recent call last)") == 1, text[-4000:]
    assert REPO.exists()


def test_the_same_exception_at_the_same_step_is_not_retried(tmp_path):
    job = run_job(tmp_path / "run", nproc=2, script="tests/user_scripts/bug_at_step.py",
                  script_args=(), timeout_s=90)
    assert not job.timed_out and job.returncodes[0] not in (0, None), job.output()
    recs = job.events("recovery")
    assert {e["gen"] for e in recs} == {1}, "one recovery (it may have moved), then stop"
    text = _all_output(job)
    assert ("rank 1 raised ValueError: bad batch shape at step 7 (at "
            "tests/user_scripts/bug_at_step.py:21) at step 7 again after recovering from "
            "it") in text, text[-3000:]
    assert "max_restarts" not in text
    fatal = job.events("job_failed")
    assert fatal and "deterministic failure" in fatal[0]["reason"], fatal
    # the traceback once (the first time, on the rank that raised), and a bounded
    # console: a reported case counted 465 lines of nested tracebacks for this script
    assert text.count("Traceback (most recent call last)") <= 2, text[-4000:]
    assert text.count("ValueError: bad batch shape") <= 6, text[-4000:]
    assert len(text.splitlines()) < 120, f"{len(text.splitlines())} lines\n{text[-4000:]}"
    assert job.elapsed_s < 45, f"took {job.elapsed_s:.1f}s"


def test_a_peer_killed_during_set_up_is_a_failure_not_a_bug(tmp_path):
    """Rank 1 is SIGKILLed (as the OOM killer would) right after ``init_process_group``,
    while rank 0 waits in DDP's set-up broadcast: rank 0's error is a consequence of a
    failure elsewhere, not a bug in the script. Before, it was reported as "rank 0
    raised CollectiveAborted ... before its first step; not retried" and the job
    stopped. Nothing was committed and every process is new, so the job starts afresh,
    as the first generation did, and completes."""
    job = run_job(tmp_path / "run", nproc=2, script="tests/user_scripts/peer_dies_in_setup.py",
                  script_args=(), timeout_s=90)
    assert not job.timed_out, job.output()
    assert job.returncodes[0] == 0, job.output()
    assert (tmp_path / "run" / "killed_in_setup").exists(), "the fault did not happen"
    text = _all_output(job)
    assert "before its first step" not in text, text[-3000:]
    assert [e["step"] for e in job.events("worker_done")] == [6, 6], job.output()
    recoveries = job.events("recovery")
    assert recoveries and {e["target_step"] for e in recoveries} == {0}, recoveries


def test_a_sigterm_while_the_reason_is_said_waits_for_it():
    """The agent stops the workers as soon as the fatal record is there; the rank that
    records it must still print its traceback and line (under load one never did)."""
    code = ("import os, signal\n"
            "from recovery.faults.user_errors import _sigterm_held\n"
            "with _sigterm_held():\n"
            "    os.kill(os.getpid(), signal.SIGTERM)  # the agent, right after the record\n"
            "    print('the traceback and the line', flush=True)\n"
            "print('never: the held SIGTERM ends the process')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stderr)
    assert proc.stdout == "the traceback and the line\n", proc.stdout


def test_a_broken_deepspeed_install_stops_the_job_with_one_line(tmp_path):
    """A DeepSpeed whose import fails (a wheel built for another torch, a missing shared
    library) fails the same way in every replacement: the zygote's preload of it must
    not hide or repeat the error, and the job stops with one line naming it."""
    pkg = tmp_path / "deepspeed"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        'raise ImportError("libcheckpointless_missing.so: cannot open shared object file")\n')
    script = tmp_path / "train_ds.py"
    script.write_text("import deepspeed\n\nfrom recovery import Checkpointless\n\n"
                      "deepspeed.init_distributed(dist_backend='gloo')\n")
    job = run_job(tmp_path / "run", nproc=2, script=str(script), script_args=(), timeout_s=60)
    text = _assert_stopped_once(job, within_s=30)
    assert ("raised ImportError: libcheckpointless_missing.so: cannot open shared object "
            "file") in text and "before its first step" in text, text[-3000:]
    assert "job failed: rank" in text
