"""``checkpointless ckpt list|show|verify|prune``: tables, ``--json``, exit statuses, and
errors that read ``checkpointless: error: ...`` (exit 2) instead of a traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from launcher.cli import main
from replication.snapshots.snapshot import SnapshotEngine
from tests.test_durable_support import config, make_state, make_writer, persist, train

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # no_dist saves



@pytest.fixture(scope="module")
def _master(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    state, objs = make_state()
    engine = SnapshotEngine(state)
    with make_writer(config(str(root), keep_last=5), 0, 1) as writer:
        for step in (10, 20, 30):
            train(objs)
            assert persist(writer, engine, step).committed
    (root / "step_40" / "rank_0").mkdir(parents=True)  # a save that died
    return root


@pytest.fixture
def root(_master, tmp_path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(_master, dst)
    return dst


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["ckpt", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_list_human_and_json(root, capsys):
    rc, out, _ = run(capsys, "list", str(root))
    assert rc == 0
    lines = out.strip().splitlines()
    assert lines[0].split()[:4] == ["STEP", "STATUS", "WORLD", "SIZE"]
    assert [ln.split()[0] for ln in lines[1:-1]] == ["10", "20", "30"]
    assert all(ln.split()[1] == "complete" for ln in lines[1:-1])
    assert "contents not re-hashed" in lines[-1]  # list never claims more than it checked
    rc, out, _ = run(capsys, "list", str(root), "--all")
    assert "incomplete (no manifest)" in out and "40" in out
    rc, out, _ = run(capsys, "list", str(root), "--json")
    doc = json.loads(out)
    assert [c["step"] for c in doc["checkpoints"]] == [10, 20, 30]
    assert doc["checkpoints"][0]["status"] == "valid" and doc["checkpoints"][0]["world_size"] == 1
    assert doc["checkpoints"][0]["contents_verified"] is False


def test_show(root, capsys):
    rc, out, _ = run(capsys, "show", str(root))
    assert rc == 0 and "step         30" in out and "rank_0/__0_0.distcp" in out
    assert "contents not verified" in out
    rc, out, _ = run(capsys, "show", str(root / "step_10"), "--json")
    doc = json.loads(out)
    assert doc["step"] == 10 and doc["manifest"]["world_size"] == 1
    assert set(doc["manifest"]["ranks"][0]["files"]) == {
        "rank_0/.metadata", "rank_0/__0_0.distcp", "rank_0/snapshot.json"}


def test_verify_reports_damage_with_exit_1(root, capsys):
    rc, out, _ = run(capsys, "verify", str(root), "--all", "--deep")
    assert rc == 0 and out.count(": ok:") == 3
    data = root / "step_20" / "rank_0" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 1
    data.write_bytes(bytes(raw))
    rc, out, _ = run(capsys, "verify", str(root), "--all")
    assert rc == 1 and "step 20: CORRUPTED" in out and "checksum" in out
    rc, out, _ = run(capsys, "verify", str(root / "step_20"), "--json")
    doc = json.loads(out)
    assert rc == 1 and doc["ok"] is False and doc["checkpoints"][0]["problems"]
    rc, _, _ = run(capsys, "verify", str(root))  # the newest one is fine
    assert rc == 0


def test_prune(root, capsys):
    rc, out, _ = run(capsys, "prune", str(root), "--keep-last", "1", "--dry-run")
    assert rc == 0 and out.count("would delete") == 2 and "spared" in out
    assert len(list(root.glob("step_*"))) == 4
    rc, out, _ = run(capsys, "prune", str(root), "--keep-last", "1", "--grace-s", "0", "--json")
    assert rc == 0 and json.loads(out)["kept"] == [30]
    assert sorted(p.name for p in root.glob("step_*")) == ["step_30"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["list", "{missing}"], "does not exist"),
        (["show", "{root}/step_40"], "incomplete"),
        (["show", "{empty}"], "no valid checkpoint"),
        (["verify", "{root}/not_a_step"], "no valid checkpoint"),
        (["list", "{root}", "-o", "novalue"], "not KEY=VALUE"),
        (["prune", "{root}", "--keep-last", "-1"], "--keep-last must be >= 0"),
        (["list", "nosuchproto://x/y"], "nosuchproto"),
    ],
)
def test_errors_exit_2_without_traceback(root, tmp_path, capsys, argv, message):
    (tmp_path / "empty").mkdir()
    fmt = {"root": root, "missing": tmp_path / "missing", "empty": tmp_path / "empty"}
    rc, out, err = run(capsys, *[a.format(**fmt) for a in argv])
    assert rc == 2, (out, err)
    assert err.startswith("checkpointless: error: ") and message in err
    assert "Traceback" not in err


def test_usage_errors_exit_2(capsys):
    assert main(["ckpt", "prune", "/tmp"]) == 2  # --keep-last is required
    assert "required" in capsys.readouterr().err
