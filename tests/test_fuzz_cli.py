"""Property-based tests of the command line: any input is an answer or a clear error.

``checkpointless config show|validate``, the argument handling of ``checkpointless
run`` (up to the point where the agent would start: the agent is replaced by a stub
that records what it was given) and ``checkpointless ckpt list|show|verify|prune`` get
arbitrary arguments, recipe texts and storage options. Every run must return 0, 1 (a
damaged checkpoint) or 2 (bad input), and a 2 must come with a ``checkpointless: error:``
line (or argparse's usage error), never with a traceback.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launcher.cli import main
from recovery.recipe import all_fields

FUZZ = settings(max_examples=100, deadline=5000, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

_KEYS = [".".join(f.path) for f in all_fields()]
_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=20)
_word = st.sampled_from(["", "x", "-", "--", "=", "a=b", "1", "-1", "0", "nan", "inf", "1e99",
                         "null", "[1, 2]", "{a: 1}", "é", "\x00", " ", "~", "${x}", "--json"])


def cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


#: ``checkpointless ckpt`` reports an exception it did not expect as "URL: TypeName: text";
#: for these types that means a bug was papered over, not bad input.
_BUG_NAMES = re.compile(r"\b(AttributeError|TypeError|KeyError|IndexError|NameError|"
                        r"UnboundLocalError|RecursionError|ZeroDivisionError|AssertionError|"
                        r"OverflowError|UnicodeDecodeError|JSONDecodeError): ")


def assert_clean(code: int, err: str, allowed: tuple[int, ...] = (0, 2)) -> None:
    assert code in allowed, (code, err)
    assert "Traceback" not in err, err
    assert not _BUG_NAMES.search(err), err
    if code == 2:
        assert "error:" in err, err


@pytest.fixture(autouse=True)
def _no_env(monkeypatch, tmp_path):
    for name in [n for n in os.environ if n.startswith("CHECKPOINTLESS_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)  # a stray run dir or recipe lands here, never in the repo


# --- config show / validate -------------------------------------------------------------
_yaml_atoms = st.sampled_from([
    "1", "-1", "1.5", ".nan", ".inf", "true", "False", "null", "~", "'x'", '"y"', "[]", "{}",
    "[1, {a: 2}]", "${replication.factor}", "${oc.env:HOME}", "${oc.env:NOPE}", "${nope:1}",
    "${}", "!!binary aGk=", "!!python/object:os.system x", "&a 3", "*a", "|\n  text",
    "2001-12-14", "0x1F", "1_000", "'${x'", "\"\\u0000\"", "!!set {a, b}",
])


def _recipe_text():
    key = st.sampled_from([*(k.split(".")[-1] for k in _KEYS), "replication", "recovery",
                           "persistence", "memory", "x", "<<", "checkpointless"])
    line = st.builds(lambda indent, k, v: f"{'  ' * indent}{k}: {v}",
                     st.integers(0, 3), key, _yaml_atoms | _text)
    return st.builds(
        lambda head, lines: "\n".join([head, *lines]),
        st.sampled_from(["checkpointless:", "a:\n  checkpointless:", "- checkpointless:",
                         "checkpointless: ${b}", "", "checkpointless: [", "%YAML 1.1\n---"]),
        st.lists(line, max_size=8),
    )


@FUZZ
@given(text=_recipe_text(), extra=st.lists(
    _word | st.builds(lambda k, v: f"{k}={v}", st.sampled_from(_KEYS) | _text, _word | _text),
    max_size=4), action=st.sampled_from(["show", "validate"]), as_json=st.booleans())
def test_config_commands(tmp_path, text, extra, action, as_json):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text, encoding="utf-8")
    flags = ["--json"] if as_json and action == "show" else []
    code, _, err = cli(["config", action, str(recipe), *flags, *extra])
    assert_clean(code, err)


@FUZZ
@given(argv=st.lists(_word | _text, max_size=5))
def test_config_with_any_arguments(argv):
    for action in ("show", "validate"):
        code, _, err = cli(["config", action, *argv])
        assert_clean(code, err)


# --- run: argument handling up to the agent ---------------------------------------------
class _StubAgent:
    started: list = []

    def __init__(self, args, cfg, run_dir, zygote=None) -> None:
        self.args, self.cfg, self.run_dir = args, cfg, run_dir
        assert zygote is None  # in-process: never forked early (launcher.zygote)

    def run(self) -> int:
        _StubAgent.started.append(self.args)
        return 0


_hosts = st.sampled_from(["127.0.0.1", "localhost", "[::1]", "10.1.2.3", "", "h:1:2", "[::1",
                          "no-such-host.invalid", "1.2.3.4:0", "1.2.3.4:99999", "x:y", "é:1",
                          "\x00:1", "a" * 300])


def _run_flags(paths: dict[str, str]):
    value = st.one_of(_word, _hosts, st.sampled_from(list(paths.values())),
                      st.integers(-5, 70000).map(str),
                      st.sampled_from(["cpu", "gpu", "auto", "all", "lo", "1:2", "join_timeout=1",
                                       "c10d", "etcd", "a" * 300]))
    flag = st.sampled_from([
        "--nproc-per-node", "--nproc_per_node", "--nnodes", "--node-rank", "--rdzv-endpoint",
        "--rdzv-id", "--rdzv-backend", "--rdzv-conf", "--master-addr", "--master-port",
        "--max-restarts", "--monitor-interval", "--run-dir", "--recipe", "--spares",
        "--job-secret-file", "--bind", "--nproc", "--bogus"])
    pair = st.tuples(flag, value).map(list)
    bare = st.sampled_from([["--standalone"], ["-m"], ["--"], ["replication.factor=2"],
                            ["recovery.fault=0:1:bogus"], ["a.b=c"],
                            ["--rdzv-conf=join_timeout=-1"]])
    return st.lists(pair | bare, max_size=6).map(lambda parts: [t for p in parts for t in p])


@pytest.fixture
def run_paths(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    good_secret = tmp_path / "secret"
    good_secret.write_text("s" * 32)
    good_secret.chmod(0o600)
    open_secret = tmp_path / "open-secret"
    open_secret.write_text("s" * 32)
    open_secret.chmod(0o644)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("checkpointless:\n  replication: {factor: 2}\n")
    return {"script": str(script), "secret": str(good_secret), "open": str(open_secret),
            "recipe": str(recipe), "dir": str(tmp_path), "missing": str(tmp_path / "missing"),
            "run_dir": str(tmp_path / "runs" / "r")}


@FUZZ
@given(data=st.data())
def test_run_argument_handling(monkeypatch, run_paths, data):
    import launcher.agent

    monkeypatch.setattr(launcher.agent, "Agent", _StubAgent)
    flags = data.draw(_run_flags(run_paths))
    script = data.draw(st.sampled_from([run_paths["script"], "missing.py", "-m", "x=1", ""]))
    env_secret = data.draw(st.sampled_from([None, "short", "e" * 32]))
    if env_secret is not None:
        monkeypatch.setenv("CHECKPOINTLESS_JOB_SECRET", env_secret)
    else:
        monkeypatch.delenv("CHECKPOINTLESS_JOB_SECRET", raising=False)
    _StubAgent.started.clear()
    code, _, err = cli(["run", *flags, script, "--script-arg"])
    assert_clean(code, err)
    if code == 0:  # the agent would have started: with everything resolved
        [args] = _StubAgent.started
        assert args.bind_plan is not None
        assert args.job_secret is not None or args.nnodes == 1 or args.host in (
            "127.0.0.1", "localhost", "::1")


# --- ckpt -------------------------------------------------------------------------------
@pytest.fixture
def ckpt_paths(tmp_path):
    root = tmp_path / "root"
    for name in ("step_1", "step_2/rank_0", "step_x", "step_-3", "step_99999999999999999999"):
        (root / name).mkdir(parents=True)
    (root / "step_2" / "MANIFEST.json").write_text('{"format": "checkpointless.durable"}')
    (root / "step_3").write_text("a file named like a step directory")
    (root / "step_4").mkdir()
    (root / "step_4" / "MANIFEST.json").write_bytes(b"\xff\xfe garbage")
    afile = tmp_path / "file"
    afile.write_text("x")
    return [str(root), str(root / "step_2"), str(root / "step_4"), str(root / "step_1"),
            str(afile), str(tmp_path / "missing"), str(tmp_path), "", "memory://nothing",
            "nosuchproto://x", "s3://", "file://" + str(root), str(root / "step_3")]


@FUZZ
@given(data=st.data())
def test_ckpt_commands(ckpt_paths, data):
    action = data.draw(st.sampled_from(["list", "show", "verify", "prune", "bogus"]))
    url = data.draw(st.sampled_from(ckpt_paths) | _text)
    opts = data.draw(st.lists(st.sampled_from(
        ["-o", "--json", "--all", "--deep", "--dry-run", "--keep-last", "--grace-s"]) | _word
        | st.builds(lambda k, v: f"{k}={v}", st.sampled_from(["anon", "a.b", "a", "", "."]),
                    _word), max_size=5))
    if action == "prune" and "--keep-last" not in opts:
        opts += ["--keep-last", data.draw(st.sampled_from(["0", "1", "-1", "x"]))]
    code, _, err = cli(["ckpt", action, url, *opts])
    assert_clean(code, err, allowed=(0, 1, 2))


def test_stub_agent_is_really_reached(monkeypatch, run_paths):
    """The property above must be able to reach the agent, or it tests nothing."""
    import launcher.agent

    monkeypatch.setattr(launcher.agent, "Agent", _StubAgent)
    _StubAgent.started.clear()
    code, _, err = cli(["run", "--standalone", "--run-dir", run_paths["run_dir"],
                        run_paths["script"]])
    assert code == 0, err
    assert len(_StubAgent.started) == 1 and Path(run_paths["run_dir"]).is_dir()
