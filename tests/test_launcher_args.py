"""``checkpointless run`` command line: spellings, overrides before the script, errors."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from launcher.cli import main
from launcher.commands.run_cmd import resolve_config
from launcher.run_args import RunArgs, UsageError, add_arguments, from_namespace, parse_endpoint
from launcher.worker_env import JobEnv
from replication import contract
from tests.launcher_scripts.harness import REPO, WORKER, clean_env

SCRIPT = str(WORKER)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in [n for n in __import__("os").environ if n.startswith("CHECKPOINTLESS_")]:
        monkeypatch.delenv(name)


def parse(*argv: str) -> RunArgs:
    parser = argparse.ArgumentParser(prog="checkpointless run", allow_abbrev=False)
    add_arguments(parser)
    return from_namespace(parser, parser.parse_args(list(argv)))


@pytest.mark.parametrize("style", ["dashed", "underscored"])
def test_both_spellings(style):
    def flag(name: str) -> str:
        return "--" + (name if style == "dashed" else name.replace("-", "_"))

    args = parse(
        flag("nproc-per-node"), "3", "--nnodes", "2:4", flag("node-rank"), "1",
        flag("rdzv-endpoint"), "head:1234", flag("rdzv-id"), "job7",
        flag("rdzv-backend"), "c10d", flag("max-restarts"), "5", flag("run-dir"), "/tmp/r",
        "--spares", "2", SCRIPT,
    )
    assert (args.nproc, args.nnodes, args.node_rank) == (3, 2, 1)
    assert (args.host, args.port, args.rdzv_id) == ("head", 1234, "job7")
    assert (args.max_restarts, args.run_dir, args.spares) == (5, "/tmp/r", 2)
    assert args.world_size == 6 and not args.is_spare_node


def test_overrides_before_script_and_script_args_untouched():
    args = parse("--nproc-per-node", "2", "replication.factor=2", "checkpointless.run_dir=/x",
                 SCRIPT, "--lr", "1", "a.b=c", "--nproc-per-node", "9")
    assert args.overrides == ("replication.factor=2", "checkpointless.run_dir=/x")
    assert args.script == SCRIPT
    assert args.script_args == ("--lr", "1", "a.b=c", "--nproc-per-node", "9")
    assert args.nproc == 2


def test_flags_after_an_override_are_still_flags():
    args = parse("recovery.max_restarts=1", "--nproc_per_node=3", "--standalone", SCRIPT, "-x")
    assert args.overrides == ("recovery.max_restarts=1",)
    assert args.nproc == 3 and args.standalone and args.port == 0
    assert args.script_args == ("-x",)


def test_module_and_double_dash():
    args = parse("-m", "pkg.train", "--epochs", "3")
    assert args.module and args.script == "pkg.train" and args.script_args == ("--epochs", "3")
    args = parse("--", SCRIPT, "x=1")
    assert args.script == SCRIPT and args.overrides == () and args.script_args == ("x=1",)


def test_defaults_like_torchrun():
    args = parse(SCRIPT)
    assert (args.nproc, args.nnodes, args.node_rank) == (1, 1, 0)
    assert (args.host, args.port, args.rdzv_id) == ("127.0.0.1", 29500, "none")
    assert parse("--rdzv-endpoint", "node1", SCRIPT).port == 29400
    assert parse("--rdzv-endpoint", "[::1]:5", SCRIPT).host == "::1"
    assert parse("--nnodes", "2", "--node-rank", "2", SCRIPT).is_spare_node


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rdzv-backend", "zookeeper", SCRIPT], "not supported"),
        (["--rdzv-backend", "etcd", SCRIPT], "needs --rdzv-endpoint listing the etcd"),
        (["--rdzv-backend", "etcd", "--rdzv-endpoint", "h1:2379,,h2", SCRIPT], "empty member"),
        (["--rdzv-backend", "etcd", "--rdzv-endpoint", "h1,h1:2379", SCRIPT], "listed twice"),
        (["--nnodes", "two", SCRIPT], "--nnodes"),
        (["--nproc-per-node", "0", SCRIPT], ">= 1"),
        (["--rdzv-endpoint", "h:99999", SCRIPT], "port"),
        (["--standalone", "--nnodes", "2", SCRIPT], "--standalone"),
        (["--spares", "-1", SCRIPT], "--spares"),
        (["replication.factor=2"], "no script"),
        (["missing_script.py"], "not found"),
    ],
)
def test_bad_values(argv, message):
    with pytest.raises(UsageError, match=message):
        parse(*argv)


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--bogus", SCRIPT],
        ["run", "--nproc-per-node", "x", SCRIPT],
        ["run", "--rdzv-backend", "etcd", SCRIPT],
        ["run", "a.b=1", "--bogus", SCRIPT],
        ["run", "--nproc", "2", SCRIPT],  # no abbreviations
    ],
)
def test_cli_usage_errors_exit_2(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "checkpointless: error:" in err and "Traceback" not in err


def test_bad_override_is_a_config_error(capsys):
    assert main(["run", "--standalone", "replication.factr=2", SCRIPT]) == 2
    assert "replication.factr" in capsys.readouterr().err


def test_help_documents_flags(capsys):
    assert main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    for text in ("--nproc-per-node", "--nproc_per_node", "--spares", "--recipe", "KEY=VALUE",
                 "--standalone", "-m", "--max-restarts", "spare node"):
        assert text in out


def test_bad_flag_in_a_real_process_has_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "run", "--rdzv_backend", "etcd", SCRIPT],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "checkpointless: error:" in proc.stderr and "Traceback" not in proc.stderr


def test_max_restarts_flag_yields_to_recipe_and_overrides(tmp_path):
    assert resolve_config(parse("--max-restarts", "4", SCRIPT)).recovery.max_restarts == 4
    recipe = tmp_path / "r.yaml"
    recipe.write_text("checkpointless:\n  recovery: {max_restarts: 7}\n")
    args = parse("--max-restarts", "4", "--recipe", str(recipe), SCRIPT)
    assert resolve_config(args).recovery.max_restarts == 7
    args = parse("--max-restarts", "4", "recovery.max_restarts=1", SCRIPT)
    assert resolve_config(args).recovery.max_restarts == 1


def test_worker_env_layers():
    job = JobEnv(store_host="h", store_port=5, nproc=2, nnodes=3, node=4, run_id="j",
                 max_restarts=9, run_dir="/r", config_json="{}")
    base = job.base({"PATH": "/bin", contract.ENV_NODE: "stale", "OMP_NUM_THREADS": "8"})
    assert base["OMP_NUM_THREADS"] == "8" and base[contract.ENV_NODE] == "4"
    assert "OMP_NUM_THREADS" in job.base({}) and "RANK" not in base
    env = job.for_rank(base, group_rank=1, local_rank=1, restart_count=2, heartbeat="/hb",
                       replacement=True)
    assert (env["RANK"], env["GROUP_RANK"], env["WORLD_SIZE"]) == ("3", "1", "6")
    assert env[contract.ENV_REPLACEMENT] == "1" and env["TORCHELASTIC_RESTART_COUNT"] == "2"
    # under srun, the agent's own task variables do not reach its workers; the job's do
    slurm = job.base({"SLURM_PROCID": "1", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0",
                      "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[0-2]"})
    assert not {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"} & set(slurm)
    assert (slurm["SLURM_JOB_ID"], slurm["SLURM_JOB_NODELIST"]) == ("7", "n[0-2]")


@pytest.mark.parametrize("endpoint,message", [
    ("localhost:99999", "--rdzv-endpoint 'localhost:99999': port must be in 1..65535, got 99999"),
    ("localhost:0", "port must be in 1..65535, got 0"),
    ("localhost:abc", "--rdzv-endpoint 'localhost:abc': port 'abc' is not an integer"),
    (":29400", "has no host"),
])
def test_a_bad_endpoint_is_named_for_what_is_wrong(endpoint, message):
    with pytest.raises(UsageError) as err:
        parse_endpoint(endpoint)
    assert message in str(err.value)


@settings(max_examples=300, deadline=None)
@given(port=st.integers())
def test_any_integer_port_is_accepted_or_refused_by_range(port):
    if 1 <= port <= 65535:
        assert parse_endpoint(f"host:{port}") == ("host", port)
    else:
        with pytest.raises(UsageError, match=r"port must be in 1\.\.65535"):
            parse_endpoint(f"host:{port}")
