"""``strategy="checkpointless"``: registration, options, and the durable checkpoint IO.

Single-process runs (``python examples/lightning_gpt.py``) exercise the whole strategy
without a launcher: generation 0 on an in-process store, snapshots at every step
boundary, ``ModelCheckpoint`` through the durable tier, and ``ckpt_path`` resumes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

from tests.recovery_harness import REPO, clean_env

pytestmark = pytest.mark.timeout(300)


def run(args: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def test_registered_without_an_import_under_the_worker_bootstrap(tmp_path):
    """``checkpointless run`` starts workers as ``python -m launcher.spare --run SCRIPT``;
    the script imports only Lightning and still resolves the strategy by name."""
    script = REPO / "tests" / "lightning_scripts" / "registered.py"
    out = run(["-m", "launcher.spare", "--run", str(script)], tmp_path).stdout
    assert "registered True CheckpointlessStrategy" in out


def test_unregistered_without_the_bootstrap(tmp_path):
    script = REPO / "tests" / "lightning_scripts" / "registered.py"
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "checkpointless" in proc.stderr


def test_instance_and_recipe_options(tmp_path):
    from lightning.pytorch import Trainer

    from recovery.integrations.lightning import CheckpointlessCheckpointIO, CheckpointlessStrategy
    from recovery.recipe import ConfigError

    recipe = tmp_path / "r.yaml"
    recipe.write_text("checkpointless:\n  replication:\n    every_n_steps: 3\n")
    strategy = CheckpointlessStrategy(recipe=recipe, overrides=["recovery.max_restarts=4"],
                                      find_unused_parameters=True)
    assert strategy.settings.replication.every_n_steps == 3
    assert strategy.settings.recovery.max_restarts == 4
    assert isinstance(strategy.checkpoint_io, CheckpointlessCheckpointIO)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False)
    assert trainer.strategy is strategy and strategy._ddp_kwargs["find_unused_parameters"]
    by_name = Trainer(strategy="checkpointless", accelerator="cpu", devices=1, logger=False)
    assert isinstance(by_name.strategy, CheckpointlessStrategy)

    recipe.write_text("checkpointless:\n  replication:\n    every_n_step: 3\n")
    with pytest.raises(ConfigError, match="every_n_step"):
        CheckpointlessStrategy(recipe=recipe)
    with pytest.raises(ConfigError, match=r"replication\.factor"):
        CheckpointlessStrategy(overrides=["replication.factor=0"])


def final(out: Path) -> dict:
    return json.loads((out / "final_rank0.json").read_text())


def test_single_process_fit_and_durable_checkpoints(tmp_path):
    """One process, no launcher: snapshots every step; ModelCheckpoint writes durable
    checkpoints (DCP + manifest); resuming from a mid-epoch one ends bit-identical to the
    uninterrupted run, and ``checkpointless://latest`` names the newest."""
    from replication.durable import latest_checkpoint

    example = str(REPO / "examples" / "lightning_gpt.py")
    common = ["--epochs", "1", "--samples", "48", "--val-every", "4"]
    a = tmp_path / "a"
    ckpts = tmp_path / "ckpts"
    run([example, *common, "--out", str(a), "--ckpt-dir", str(ckpts), "--ckpt-every", "5",
         "--recipe", str(REPO / "examples" / "recipes" / "lightning_gpt.yaml")], tmp_path)
    names = sorted(p.name for p in ckpts.iterdir())
    assert "epoch=0-step=5.ckpt" in names and "last.ckpt" in names, names
    info = latest_checkpoint(str(ckpts / "epoch=0-step=5.ckpt"))
    assert info is not None and info.step == 5 and info.world_size == 1
    assert (Path(info.url) / "rank_0" / ".metadata").exists()  # a standard DCP checkpoint
    assert final(a)["step"] == 12

    b = tmp_path / "b"
    run([example, *common, "--out", str(b), "--resume", str(ckpts / "epoch=0-step=5.ckpt")],
        tmp_path)
    assert final(b) == final(a), "a resume from step 5 must end where the full run ended"

    c = tmp_path / "c"
    proc = run([example, *common, "--epochs", "2", "--out", str(c), "--ckpt-dir", str(ckpts),
                "--resume", "checkpointless://latest"], tmp_path)
    assert "Restoring states from the checkpoint path at" in proc.stdout + proc.stderr
    assert final(c)["step"] == 24


def test_bad_world_is_refused_clearly(tmp_path):
    """Trainer(devices=2) without a launcher: one process cannot be rank 0 of 2."""
    script = tmp_path / "two.py"
    script.write_text(
        "import lightning.pytorch as pl, torch\n"
        "import recovery.integrations.lightning\n"
        "from lightning.pytorch.demos.boring_classes import BoringModel\n"
        "pl.Trainer(strategy='checkpointless', accelerator='cpu', devices=2, logger=False,"
        " max_steps=1).fit(BoringModel())\n")
    env = {k: v for k, v in clean_env().items() if k not in ("RANK", "WORLD_SIZE")}
    env.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "GROUP_RANK": "0"})
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "rank 0 of 1 (RANK/WORLD_SIZE)" in proc.stderr or "devices" in proc.stderr, \
        proc.stderr[-3000:]
