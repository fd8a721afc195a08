"""Open checkpoints written under ``strategy="checkpointless"`` with plain Lightning.

``python -m tests.lightning_scripts.plain_load EXPORTED.ckpt DURABLE_DIR OUT.json``:

1. ``Classifier.load_from_checkpoint(EXPORTED)`` (a file from ``checkpointless ckpt export
   --lightning``) and ``Trainer(...).fit(model, ckpt_path=EXPORTED)`` one epoch further,
   with Lightning's default strategy and checkpoint IO;
2. ``Trainer(plugins=[CheckpointlessCheckpointIO()]).fit(model, ckpt_path=DURABLE_DIR)``,
   the durable directory itself, without the strategy.

Writes what it saw to OUT.json; nothing of checkpointless is imported for step 1.
"""

from __future__ import annotations

import json
import sys

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from tests.lightning_scripts.conformance import Classifier, dataset


def _fit(model: pl.LightningModule, ckpt: str, epochs: int, **kwargs) -> pl.Trainer:
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, **kwargs)
    trainer.fit(model, DataLoader(dataset(192, 0), batch_size=4, shuffle=True),
                DataLoader(dataset(48, 1), batch_size=4), ckpt_path=ckpt)
    return trainer


def main() -> None:
    exported, durable, out = sys.argv[1:4]
    torch.set_num_threads(1)
    model = Classifier.load_from_checkpoint(exported)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    raw = torch.load(exported, weights_only=False)
    same = all(torch.equal(weights[k], raw["state_dict"][k]) for k in raw["state_dict"])
    first = _fit(Classifier(), exported, epochs=raw["epoch"] + 2)
    assert "recovery" not in sys.modules, "plain Lightning must not import checkpointless"

    from recovery.integrations.lightning import CheckpointlessCheckpointIO

    second = _fit(Classifier(), durable, epochs=raw["epoch"] + 2,
                  plugins=[CheckpointlessCheckpointIO()])
    with open(out, "w") as f:
        json.dump({"loaded_step": raw["global_step"], "weights_match": same,
                   "hparams": dict(model.hparams), "fit_exported_step": first.global_step,
                   "fit_durable_step": second.global_step}, f)


if __name__ == "__main__":
    main()
