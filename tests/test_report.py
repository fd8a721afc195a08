"""``checkpointless report``: bad input, torn files and the run model, without a browser.

The end-to-end test (a real run with a SIGKILLed worker, opened in headless Chromium)
is ``tests/test_report_browser.py``. Here the events files are written by hand, in the
exact shape ``recovery.generation.protocol.EventLog`` writes, to reach cases a short real run
cannot produce on demand: a failure during recovery, a torn last line, damaged lines.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.cli import main
from launcher.report.model import build_run
from tests.recovery_harness import REPO, clean_env

T0 = 1_700_000_000.0


def _ev(dt: float, event: str, source: str, **fields) -> dict:
    return {"ts": T0 + dt, "event": event, "source": source, **fields}


def _timings(detect: float) -> dict:
    return {"detect_s": detect, "abort_s": 0.01, "rendezvous_s": 0.2, "rendezvous_join_s": 0.1,
            "transfer_s": 0.05}


def _events() -> list[dict]:
    """Two ranks; a SIGKILL of rank 1 at step 6, then a failure during that recovery."""
    ev = [_ev(0, "agent_start", "agent0", node=0, pid=1, role="ranks [0, 1]", world_size=2,
              cwd="/", config={"persistence": {"path": ""}})]
    ev += [_ev(1 + 0.1 * s, "step", "rank0", step=s, gen=0, stall_s=0.01,
               replicated={"step": s - 1, "seal_s": 0.0, "transfer_s": 0.01, "commit_s": 0.0,
                           "bytes_sent": 1000, "bytes_received": 1000, "segments_skipped": 0})
           for s in range(1, 6)]
    kill = {"kind": "worker_exit", "rank": 1, "node": 0, "exitcode": -9, "signal": "SIGKILL",
            "ts": T0 + 2.0}
    during = {"kind": "failure_during_recovery", "rank": 0, "error": "boom", "ts": T0 + 2.5}
    ev += [
        _ev(1.95, "fault_injected", "rank1", fault="1:6:forward:sigkill", rank=1, step=6,
            phase="forward", kind="sigkill", committed=4),
        _ev(2.0, "worker_exit", "agent0", node=0, rank=1, pid=2, exitcode=-9, signal="SIGKILL"),
        _ev(2.0, "failure_declared", "agent0", node=0, gen=1, observed_gen=0, cause=kill,
            recoveries=1),
        _ev(2.01, "replacement_assigned", "agent0", node=0, rank=1, pid=3, spare=True, gen=1,
            seconds_since_detection=0.001),
        _ev(2.5, "recovery_interrupted", "rank0", gen=1, error="boom"),
    ]
    for rank in (0, 1):
        ev.append(_ev(3.0 + rank * 0.1, "recovery", f"rank{rank}", rank=rank, gen=2,
                      cause=during, local_cause={}, target_step=4, newcomers=[1],
                      providers={"1": 0}, bytes_transferred=5000 * rank, newcomer=rank == 1,
                      timings=_timings(0.24 + 0.1 * rank),  # consistent with recovered_at
                      recovered_at=T0 + 3.0 + rank * 0.1))
        ev.append(_ev(3.3, "resumed", f"rank{rank}", step=5, resume_s=0.2, gen=2))
    ev += [_ev(3.3 + 0.1 * s, "step", "rank0", step=s, gen=2, stall_s=0.01, replicated=None)
           for s in range(5, 9)]
    ev += [_ev(4.5, "worker_done", f"rank{r}", step=8, gen=2) for r in (0, 1)]
    # rank 1 stalls on its way out after training: the agent records it done, no failure
    ev.append(_ev(4.55, "worker_hung", "agent0", node=0, rank=1, pid=3, silent_s=3.0))
    ev.append(_ev(4.6, "job_done", "agent0", node=0, recoveries=2, committed_step=8))
    return ev


def _write(run_dir: Path, events: list[dict], tail: str = "") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(e) + "\n" for e in events) + tail
    (run_dir / "events.jsonl").write_text(text)
    return run_dir


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["report", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_model_folds_a_failure_during_recovery_into_one_episode():
    run = build_run(_events())
    assert run.world_size == 2 and run.agents == [0] and run.final_step == 8
    # generation 1 was superseded before anyone resumed: one failure, generations 1-2
    assert [f.gen for f in run.failures] == [2]
    (failure,) = run.failures
    assert failure.superseded == [1] and failure.gens_text == "1-2"
    assert failure.what == ["rank 1 on node 0 was killed by SIGKILL",
                            "failure during recovery, seen by rank 0: boom"]
    assert failure.faults == ["1:6:forward:sigkill"]
    assert failure.replacements == ["rank 1 -> a warm spare (pid 3)"]
    assert failure.recovered and failure.target_step == 4 and failure.critical_rank == 1
    assert failure.newcomers == [1] and failure.bytes_transferred == 5000
    # steps 1..5 were done before the failure was detected; the job went back to 4
    assert failure.steps_lost == 1
    # from the fault (1.95) to the first step after the recovery (3.3)
    assert failure.recovery_s == pytest.approx(3.3 - 1.95)
    # the critical rank's phases: disjoint intervals that add up to the recovery time
    assert failure.phases == pytest.approx({
        "detect_s": 2.84 - 1.95, "abort_s": 0.01, "rendezvous_s": 0.2, "transfer_s": 0.05,
        "first_step_s": 0.2})
    assert sum(failure.phases.values()) == pytest.approx(failure.recovery_s)
    assert len(run.replications) == 5 and run.outcome == "completed"
    failure_marks = [label for _, lane, label in run.marks if lane == "failures"]
    assert failure_marks == ["fault 1:6:forward:sigkill", "rank 1 SIGKILL"]


def test_phases_of_a_rank_that_noticed_before_the_episode_start_at_it():
    """A rank whose own detect and abort predate the failure time (it noticed an earlier
    generation's failure) must not stretch the bar past the recovery time."""
    ev = _events()
    for e in ev:
        if e["event"] == "recovery":
            e["timings"] = {"detect_s": 0.0, "abort_s": 0.01, "rendezvous_s": 2.0,
                            "transfer_s": 0.05}
    run = build_run(ev)
    (failure,) = run.failures
    assert failure.phases["detect_s"] == 0.0 and failure.phases["abort_s"] == 0.0
    assert sum(failure.phases.values()) == pytest.approx(failure.recovery_s)


def test_report_of_handmade_run(tmp_path, capsys):
    run_dir = _write(tmp_path / "run", _events())
    code, out, err = _cli(capsys, str(run_dir))
    assert code == 0, err
    page = (run_dir / "report.html").read_text()
    assert "rank 1 on node 0 was killed by SIGKILL" in page
    assert "failure during recovery, seen by rank 0: boom" in page
    assert "<td>1-2</td>" in page
    assert "persistence.path was not set" in page
    assert f"wrote {run_dir / 'report.html'}" in out
    assert "read 23 events" in err and "drawing" in err
    assert page.count('src="data:image/png;base64,') == 3


def test_output_path_and_torn_last_line(tmp_path, capsys):
    run_dir = _write(tmp_path / "run", _events(), tail='{"ts": 17000, "event": "st')
    target = tmp_path / "out" / "r.html"
    code, _, err = _cli(capsys, str(run_dir), "-o", str(target))
    assert code == 0, err
    assert target.exists() and not (run_dir / "report.html").exists()
    assert "skipped a torn last line" in err
    assert "a torn last line was skipped" in target.read_text()


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        pytest.param(lambda d: None, "does not exist", id="missing-dir"),
        pytest.param(lambda d: d.write_text("x"), "is not a directory", id="not-a-dir"),
        pytest.param(lambda d: d.mkdir(), "no events file", id="no-events-file"),
        pytest.param(lambda d: _write(d, []), "no events in the file (it is empty)", id="empty"),
        pytest.param(lambda d: _write(d, [], tail='{"ts": 1, "ev'),
                     "only a torn line", id="only-torn"),
        pytest.param(lambda d: (_write(d, []), (d / "events.jsonl").write_text(
            '{"ts": 1, "event": "a"}\nnot json\n{"ts": 2, "event": "b"}\n')),
            "line 2: not a JSON event", id="garbage-line"),
        pytest.param(lambda d: _write(d, [{"ts": 1, "event": "a"}, [1, 2]]),
                     "line 2: expected a JSON object, got list", id="not-an-object"),
        pytest.param(lambda d: _write(d, [{"event": "a"}, {"ts": 2, "event": "b"}]),
                     "line 1: the event has no numeric 'ts' (got None)", id="no-ts"),
        pytest.param(lambda d: _write(d, [{"ts": 1}, {"ts": 2, "event": "b"}]),
                     "line 1: the event has no 'event' name", id="no-name"),
        pytest.param(lambda d: _write(d, [{"ts": 1, "event": "recovery", "gen": "1"},
                                          {"ts": 2, "event": "b"}]),
                     "line 1: a 'recovery' event needs 'gen' as int (got '1')", id="bad-field"),
    ],
)
def test_bad_input_is_a_clear_error(tmp_path, capsys, setup, expected):
    run_dir = tmp_path / "run"
    setup(run_dir)
    code, out, err = _cli(capsys, str(run_dir))
    assert code == 2, (out, err)
    assert err.startswith("checkpointless: error: "), err
    assert expected in err, err
    assert "Traceback" not in err and not out


def test_bad_checkpoints_url_and_output(tmp_path, capsys):
    run_dir = _write(tmp_path / "run", _events())
    code, _, err = _cli(capsys, str(run_dir), "--checkpoints", str(tmp_path / "nowhere"))
    assert code == 2 and "checkpointless: error: --checkpoints" in err and "not found" in err
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, err = _cli(capsys, str(run_dir), "-o", str(blocker / "r.html"))
    assert code == 2 and f"checkpointless: error: cannot write {blocker / 'r.html'}" in err
    code, _, err = _cli(capsys, str(run_dir), "--checkpoints", str(tmp_path),
                        "--storage-option", "novalue")
    assert code == 2 and "'novalue' is not KEY=VALUE" in err


def test_help_stays_light():
    """``checkpointless --help`` and ``report --help`` never import matplotlib."""
    code = ("import sys; from launcher.cli import main; main(['--help']); "
            "main(['report', '--help']); "
            "print('HEAVY', sorted(m for m in sys.modules if m.startswith('matplotlib')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "report" in done.stdout and "--checkpoints" in done.stdout
    assert "HEAVY []" in done.stdout, done.stdout


def test_recorded_config_leaves_storage_secrets_out():
    from launcher.report.record import REDACTED, recorded_config
    from recovery.recipe import load_config

    cfg = load_config(None, ["persistence.path=s3://b/run",
                             'persistence.storage_options={"key": "AKIA1", "secret": "s3cr3t"}'])
    data = recorded_config(cfg)
    assert data["persistence"]["path"] == "s3://b/run"
    assert data["persistence"]["storage_options"] == {"key": REDACTED, "secret": REDACTED}
    assert "s3cr3t" not in json.dumps(data)
    assert cfg.persistence.storage_options["secret"] == "s3cr3t"  # the live config is intact


def test_worker_output_relay_prefixes_whole_lines(capfd):
    """The agent's copy of a worker's output: whole lines, prefixed; a spare's lines take
    the rank it is handed; a last line without a newline is not lost."""
    from launcher import worker_output

    script = ("import sys; sys.stdin.readline(); print('hello'); "
              "sys.stderr.write('to err\\nno newline')")
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    worker_output.relay(proc, "spare")
    worker_output.relabel(proc.pid, "rank7")  # handed a rank before it printed anything
    proc.stdin.write(b"go\n")
    proc.stdin.close()
    proc.wait(timeout=30)
    worker_output.drain(10.0)
    out, err = capfd.readouterr()
    assert out == "[rank7]: hello\n"
    assert err == "[rank7]: to err\n[rank7]: no newline\n"


def test_worker_output_is_prefixed_once_whatever_the_depth(capfd):
    """torch's rank prefixes, nested when an error quotes another (seen 12 deep),
    or naming the rank a process had before it was handed another: one label, the
    process's own rank now."""
    from launcher import worker_output

    lines = ["[rank1]: [rank1]: [rank1]: RuntimeError: boom", "[rank0]: quoted",
             "[rank1]:tight", "plain [rank1]: inside", "[ranks]: not a prefix"]
    script = "import sys; sys.stdout.write(sys.argv[1])"
    proc = subprocess.Popen([sys.executable, "-c", script, "\n".join(lines) + "\n"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    worker_output.relay(proc, "rank1")
    proc.wait(timeout=30)
    worker_output.drain(10.0)
    out, _ = capfd.readouterr()
    assert out.splitlines() == ["[rank1]: RuntimeError: boom", "[rank1]: quoted",
                                "[rank1]: tight", "[rank1]: plain [rank1]: inside",
                                "[rank1]: [ranks]: not a prefix"]
