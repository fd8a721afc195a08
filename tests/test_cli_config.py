"""``checkpointless config show|validate``, in-process and as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from launcher.cli import main
from recovery.recipe import CheckpointlessConfig

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """The developer's own CHECKPOINTLESS_* variables must not leak into these tests."""
    for name in list(os.environ):
        if name.startswith("CHECKPOINTLESS_"):
            monkeypatch.delenv(name)


@pytest.fixture
def recipe(tmp_path) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(
        textwrap.dedent(
            """
            name: exp
            exp_manager:
              checkpointless:
                run_dir: /runs/${name}
                replication: {factor: 3}
            """
        )
    )
    return path


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CHECKPOINTLESS_")}
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", *args],
        cwd=REPO,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


# --- in-process ---------------------------------------------------------------------


def test_show_prints_resolved_yaml(capsys, recipe):
    assert main(["config", "show", str(recipe), "replication.every_n_steps=2"]) == 0
    out = capsys.readouterr().out
    block = yaml.safe_load(out)["checkpointless"]
    assert block["run_dir"] == "/runs/exp"
    assert block["replication"]["factor"] == 3
    assert block["replication"]["every_n_steps"] == 2


def test_show_without_recipe_takes_overrides_only(capsys):
    assert main(["config", "show", "replication.factor=4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["replication"]["factor"] == 4
    assert data == {**CheckpointlessConfig().to_dict(), "replication": data["replication"]}


def test_show_reads_the_environment_unless_told_not_to(capsys, monkeypatch):
    monkeypatch.setenv("CHECKPOINTLESS_REPLICATION_FACTOR", "5")
    assert main(["config", "show", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["replication"]["factor"] == 5
    assert main(["config", "show", "--json", "--ignore-env"]) == 0
    assert json.loads(capsys.readouterr().out)["replication"]["factor"] == 2


def test_show_comments(capsys):
    assert main(["config", "show", "--comments"]) == 0
    assert "# copies of each rank's state, its own included" in capsys.readouterr().out


def test_validate_ok(capsys, recipe):
    assert main(["config", "validate", str(recipe)]) == 0
    assert capsys.readouterr().out.strip() == "ok"


def test_validate_reports_every_problem_on_stderr(capsys, recipe):
    code = main(["config", "validate", str(recipe), "replication.factor=0", "memory.budget=1"])
    assert code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("checkpointless: error: invalid configuration (2 problems):")
    assert "checkpointless.replication.factor: got '0'" in captured.err
    assert "did you mean 'checkpointless.memory.host_budget_bytes'?" in captured.err


def test_validate_requires_a_recipe(capsys):
    assert main(["config", "validate"]) == 2
    assert "checkpointless config validate: error:" in capsys.readouterr().err


def test_help_lists_every_key(capsys):
    assert main(["config", "show", "--help"]) == 0
    out = capsys.readouterr().out
    assert "replication.factor" in out
    assert "copies of each rank's state" in out


@pytest.mark.parametrize("argv", [[], ["nope"], ["config"], ["config", "frobnicate"]])
def test_usage_errors_exit_2(capsys, argv):
    assert main(argv) == 2
    assert "error:" in capsys.readouterr().err


# --- as a subprocess ----------------------------------------------------------------


def test_subprocess_show(recipe):
    result = run_cli(
        "config", "show", str(recipe), "persistence.path=s3://b/x",
        env={"CHECKPOINTLESS_MEMORY_HOST_BUDGET_BYTES": "1000"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    block = yaml.safe_load(result.stdout)["checkpointless"]
    assert block["replication"]["factor"] == 3
    assert block["persistence"]["path"] == "s3://b/x"
    assert block["memory"]["host_budget_bytes"] == 1000


def test_subprocess_show_json():
    result = run_cli("config", "show", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == CheckpointlessConfig().to_dict()


@pytest.mark.parametrize(
    ("args", "env", "fragment"),
    [
        (["config", "show", "replication.factor=x"], {}, "checkpointless.replication.factor"),
        (["config", "show", "replication.factor=2", "oops"], {}, "'oops': not an override"),
        (["config", "show"], {"CHECKPOINTLESS_BOGUS": "1"}, "CHECKPOINTLESS_BOGUS"),
        (["config", "validate", "/does/not/exist.yaml"], {}, "recipe file not found"),
        (["config", "show", "--no-such-flag"], {}, "unrecognized arguments"),
    ],
)
def test_subprocess_bad_input_exits_2_without_traceback(args, env, fragment):
    result = run_cli(*args, env=env)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "checkpointless" in result.stderr and "error:" in result.stderr
    assert fragment in result.stderr
    assert result.stdout == ""


def test_subprocess_invalid_yaml_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("checkpointless:\n  replication: {factor: 2\n")
    result = run_cli("config", "validate", str(bad))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert str(bad) in result.stderr
    assert "not valid YAML: line" in result.stderr


def test_subprocess_validates_shipped_recipes():
    for name in ("default.yaml", "nemo_nested.yaml"):
        result = run_cli("config", "validate", str(REPO / "examples" / "recipes" / name))
        assert (result.returncode, result.stdout.strip()) == (0, "ok"), result.stderr


def test_version_names_ours_torch_and_python(capsys):
    from launcher.cli import main

    assert main(["--version"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("checkpointless 0.1.0 (torch 2.13.0"), out
    assert "python 3." in out


def test_chaos_works_from_any_directory(tmp_path):
    """The installed ``checkpointless`` console script, outside the checkout: ``chaos``
    finds the benchmark beside the editable install (it once worked only as
    ``python -m launcher.cli chaos`` from the repository root)."""
    exe = Path(sys.executable).with_name("checkpointless")
    result = subprocess.run([str(exe), "chaos", "--help"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--quick" in result.stdout and "--seed" in result.stdout, result.stdout
