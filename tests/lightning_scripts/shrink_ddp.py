"""A Lightning job as people write one, recording what each step trained on.

A ``LightningModule`` with a plain ``DataLoader`` (Lightning adds the
``DistributedSampler``), ``Trainer(strategy="checkpointless", devices=2, num_nodes=2)``,
a ``CSVLogger``. Each training step appends to a file per launch rank (append mode: a
script that may run again must) the step, the generation, the world size and the sample
indices of its batch; the final weights go to ``final_slot<launch rank>.json``.
"""

from __future__ import annotations

import argparse
import json
import os

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader

from tests.launcher_scripts.indexed_data import Indexed


class Regression(pl.LightningModule):
    def __init__(self, out: str, samples: int, batch: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.out, self.samples, self.batch = out, samples, batch
        self._log = None

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Indexed(self.samples), batch_size=self.batch, shuffle=True)

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        session = self.trainer.strategy.session
        if self._log is None:
            self._log = open(os.path.join(self.out, f"steps_slot{session.slot}.jsonl"),  # noqa: SIM115
                             "a")
        self._log.write(json.dumps({"step": self.trainer.global_step + 1, "gen": session.gen,
                                    "world": self.trainer.world_size, "slot": session.slot,
                                    "index": index.tolist()}) + "\n")
        self._log.flush()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--samples", type=int, default=384)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    pl.seed_everything(1)
    model = Regression(args.out, args.samples, args.batch)
    trainer = pl.Trainer(strategy="checkpointless", accelerator="cpu", devices=2, num_nodes=2,
                         max_epochs=args.epochs, logger=CSVLogger(args.out, name="csv"),
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, log_every_n_steps=1)
    trainer.fit(model)
    session = trainer.strategy.session
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    with open(os.path.join(args.out, f"final_slot{session.slot}.json"), "w") as f:
        json.dump({"slot": session.slot, "world": trainer.world_size,
                   "step": trainer.global_step, "weights": weights.tolist()}, f)


if __name__ == "__main__":
    main()
